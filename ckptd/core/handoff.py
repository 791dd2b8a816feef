"""The files under ``<watch dir>/.ckptd/`` through which the daemon and the trainer talk.

Both sides import these names from here, and only from here: the daemon writes
``preemption.json`` (a notice) and ``advice.json`` (the advised cadence) and holds
``daemon.lock``; the trainer helpers (``ckptd.trainer``) read the first two and append
``saves.jsonl`` (their save reports). A name spelled on one side only would let the two drift
apart silently. Standard library only, and nothing else of ckptd, so that the trainer helpers
(which import nothing of the daemon) can import it. Formats: docs/design.md, "Trainer
signalling".
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ADVICE", "DAEMON_LOCK", "DIR", "NOTICE", "SAVES", "STEPS", "TRAINER_VARIABLES"]

# The directory, relative to the watch dir; the daemon skips it when it scans for checkpoints.
DIR = Path(".ckptd")
# A preemption notice, written atomically by the daemon's responder.
NOTICE = DIR / "preemption.json"
# The advised checkpoint cadence, written atomically by the daemon's advisor.
ADVICE = DIR / "advice.json"
# The trainer's save reports, one JSON line per save and rank, appended by the trainer.
SAVES = DIR / "saves.jsonl"
# The trainer's step report (the step it is at), replaced atomically a few times a minute.
STEPS = DIR / "steps.json"
# The daemon's lock on the watch dir (one daemon per watch dir).
DAEMON_LOCK = DIR / "daemon.lock"

# The environment variables the trainer helpers read: ``ckptd exec`` sets all but the last
# for its trainer, and a user may set the last. They are not settings of the daemon, which
# refuses any other ``CKPTD_*`` name it does not know (a typo), so it passes these by.
TRAINER_VARIABLES = frozenset(
    {
        "CKPTD_RESUME_FROM",
        "CKPTD_RUN",
        "CKPTD_WATCH_DIR",
        "CKPTD_SIGNAL",
        "CKPTD_URL",
        "CKPTD_TOKEN",
        "CKPTD_STEP_REPORT_SECONDS",
    }
)
