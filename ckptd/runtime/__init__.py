"""Process plumbing: the clock, logs, metrics, yielding to the trainer, the recorded
environment, the instance lock and early writeback."""
