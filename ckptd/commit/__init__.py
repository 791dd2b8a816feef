"""The commit protocol: how a checkpoint becomes committed, in one place.

Anything that ships calls these steps (the pipeline, one node or many): they take a
``ckptd.repository.Repository`` and records of verified files, keep no pipeline state and
use no asyncio (blocking; callers run them in a thread).

    single     one node's commit: the manifest by a conditional write, then LATEST
    parts      many nodes (pure): announcement and part formats, the save id, the merge
    objects    many nodes: reading and writing announcements and parts
    assemble   many nodes: announce, withdraw, and the global commit of every part
"""
