"""Notice sources: one per channel (AWS, GCP, Azure metadata; our own SIGTERM).

Each source is an async iterator of :class:`Notice` (see ``model.py``); the responder
consumes Notices and knows no cloud. ``make_source`` picks the metadata source from the
``[preemption]`` config; the service adds a :class:`SigtermSource` beside it.

The package imports nothing itself: the metadata sources need aiohttp, which a node with
no cloud (or ``run --once``) never loads; import each from its module.
"""
