"""The drill: a simulated preemption followed the whole way to a trainer that loads the
checkpoint, by hand (``ckptd drill``) or on a schedule (``[drill] every``), each drill
recorded beside its run in the store (docs/preemption.md, "The drill").

- ``model``: the stages, the record, the schedule and the success rate (pure);
- ``proof``: restore into a scratch dir, verify every byte on disk, run the load check;
- ``runner``: a whole drill on the daemon (the responder's notice, then the proof), its
  record, its metrics, each run's drill history;
- ``schedule``: the daemon's schedule, what blocks a drill, one drill per period across
  a cluster;
- ``standalone``: the restore-only drill, from any node that reaches the store.
"""
