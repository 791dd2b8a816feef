"""A cluster restore that reads each byte from the store once.

When several nodes of a run restore the same checkpoint at once (a job replaced whole,
``ckptd exec`` on every node, a pod's restore step), they find each other through the
store (``rendezvous``), each fetches from the store what no other node has or is
fetching, verified against the manifest, and reads the rest from the node that verified
it (``board`` decides, ``storage`` reads, ``server`` serves, ``session`` runs one node's
part). Every node ends with the whole checkpoint, verified and in place as any restore
leaves it. The invariant: a participant only ever supplies bytes, each file held to the
store's manifest by the node that keeps it; whatever a participant does (dies, stalls,
serves damaged bytes) costs time or store egress, never a wrong byte.
"""
