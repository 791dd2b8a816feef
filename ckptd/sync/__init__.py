"""The write side: from a file written in a watch dir to a committed checkpoint in the store.

``pipeline`` (hints, timers, the worker) hands a checkpoint from the ``scanner``/``watcher``
to ``intake`` (complete yet?), the pure ``queue`` (what goes next), ``outcomes`` (ship it
and act on the result) and ``emergency`` (a notice puts its checkpoint first); ``plan``
(pure) says what to send, copy or skip, ``ship`` and ``transfer`` move the bytes, ``commit``
writes the manifest and ``LATEST`` in that order, and ``journal`` records only what the
store made durable. ``early`` sends the files of a checkpoint not yet complete.
"""
