"""The trainer's report of what it resumed from: ``<watch dir>/.ckptd/resumed.json``.

``report_resumed(path)`` once at start-up, after loading a checkpoint (``None``: started
from scratch), tells the daemon which line of training the trainer's saves continue
(docs/design.md "Trajectories"): resuming from the run's newest checkpoint continues it;
resuming from an older one (a rollback after a loss spike) or from scratch starts a new
trajectory, whose saves commit even under names the abandoned one used, and which LATEST
then follows. Without a report the daemon takes the trainer to continue the run's newest
(``ckptd exec`` reports for its child what it restored).

Replaced atomically (tmp + rename) with ``{"checkpoint", "pid", "at"}``: the checkpoint's
name in the watch dir (its last path component) or null, the reporting process, and the
Unix time. Only local rank 0 writes. Never raises. ``load_training_state`` and the
Hugging Face and Lightning callbacks report by themselves.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ckptd.core.handoff import RESUMED, replace_json

__all__ = ["report_resumed"]

log = logging.getLogger("ckptd.trainer")


def report_resumed(
    checkpoint: str | os.PathLike[str] | None,
    watch_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Report that the trainer resumed from ``checkpoint`` (a path or a name in the watch
    dir; None: from scratch). The watch dir is ``watch_dir``, else ``CKPTD_WATCH_DIR``,
    else the checkpoint path's parent when a daemon watches it (it holds ``.ckptd/``). A
    no-op without one, or on a local rank other than 0."""
    where = watch_dir if watch_dir is not None else os.environ.get("CKPTD_WATCH_DIR")
    if not where and checkpoint is not None:
        parent = Path(checkpoint).parent
        where = str(parent) if (parent / RESUMED.parent).is_dir() else None
    if not where or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    name = None if checkpoint is None else Path(checkpoint).name
    body = {"checkpoint": name, "pid": os.getpid(), "at": time.time()}
    try:
        replace_json(Path(where) / RESUMED, body)
    except OSError as exc:
        log.debug("ckptd: cannot report what the trainer resumed from: %s", exc)
