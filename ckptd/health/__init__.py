"""Health sources: faults that come with no notice, heard before they take the node.

One module per source, each a pure reading of one documented interface, all producing
one ``HealthEvent`` (``model``): ``kmsg``, the kernel log's Xid, OOM-kill and I/O-error
lines, with the Xid table in ``xid``; ``gpu``, a GPU's readings as events, from a DCGM
exporter's page (``dcgm``) or NVML (``nvml``, the one reader that is its own I/O edge);
``memory``, PSI and the trainer's cgroup; ``disk``, the checkpoint filesystem's free
space, and ``diskstats``, its device's latency; ``store``, the store's reachability.
``decide`` says what an event does (save, save-and-stop, report), rate-limited;
``readers`` is the I/O edge; ``condition`` the file a platform drains by; ``monitor``
polls the readers and hands decisions to the daemon, which knows how to make the
trainer save (``ckptd.daemon.health_loop``). docs/health.md.
"""
