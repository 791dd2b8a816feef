"""Peer replication: a node's part of a checkpoint, safe on another node's disk in seconds.

The store may need minutes for a node's part; the cluster network to a peer, seconds.
Each daemon (``[peers] enabled``) serves a port on which the other nodes of its run push
their parts (``server``, ``client``), holds what it receives in a replica directory with a
quota (``replicas``), finds its peers through the store (``discovery``, ``placement``),
and serves what it holds to a restore. What lives here:

- ``model`` (pure): the replica, the offer that starts one, the peer announcement, the
  chunks a file is sent in, which holding can serve which file of a manifest;
- ``placement`` (pure): which peers take a part (another failure domain first);
- ``auth`` (pure): the signed requests every call carries (the cluster's token);
- ``replicas``: the replica directory, written fd-relative and ``O_NOFOLLOW``;
- ``server``/``client``: the transport (aiohttp), chunked, each chunk CRC-checked,
  resumable, rate-limited on the sending side (``pacing``);
- ``discovery``: the announcements under ``<run>/.ckptd-peers/`` (``ckptd.repository``
  spells the keys);
- ``source``: a peer-first byte source a restore reads through.

The write side (``ckptd.sync.replicate``, ``ckptd.sync.handoff``) uses these to push a part
during an emergency and to finish a dead node's store upload; ``ckptd.daemon.peering``
runs them. docs/peers.md says when to use it; docs/design.md "Peer replication" is exact.
"""
