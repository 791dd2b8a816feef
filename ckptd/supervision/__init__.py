"""``ckptd exec``: the trainer as the daemon's supervised child, and when to restart it."""
