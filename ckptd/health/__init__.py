"""Health sources: faults that come with no notice, heard before they take the node.

One module per source, each a pure reading of one documented interface (``kmsg``: the
kernel log's Xid, OOM-kill and I/O-error lines, with the Xid table in ``xid``; ``memory``:
PSI and the trainer's cgroup; ``disk``: the checkpoint filesystem's free space; ``store``:
the store's reachability), all producing one ``HealthEvent`` (``model``). ``decide`` says
what an event does (save, save-and-stop, report), rate-limited; ``readers`` is the I/O
edge; ``monitor`` polls the readers and hands decisions to the daemon, which knows how to
make the trainer save (``ckptd.daemon.health_loop``). docs/health.md.
"""
