"""Trainer scripts the tests run as child processes (by path or with ``python -m``): toy
loops for signals and notices, and deterministic HF, Lightning, DCP and DeepSpeed trainers
for the lossless-resume, ``ckptd exec`` and many-node tests (``common`` is theirs,
``procs`` is what a test uses to start and watch one)."""
