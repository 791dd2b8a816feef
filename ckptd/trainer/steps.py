"""The trainer's step report: ``<watch dir>/.ckptd/steps.json``, the step it is at.

``report_step(step)`` after each optimizer step costs a clock read and a comparison; at
most every ``CKPTD_STEP_REPORT_SECONDS`` (default 5; 0: every call) it replaces the file
(tmp + rename) with ``{"step", "at", "pid", "first_step", "first_at"}``: the step, the
Unix time of the report, the reporting process, and its first step and that step's time. No
device sync: the step is the caller's integer. The daemon (``ckptd exec``'s goodput
recorder) reads it to tell training from start-up and to count the steps an interruption
loses. Only local rank 0 writes (every rank is at the same step). Never raises.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from ckptd.core.handoff import STEPS

__all__ = ["STEPS_RELPATH", "report_step"]

STEPS_RELPATH = STEPS
DEFAULT_REPORT_SECONDS = 5.0
log = logging.getLogger("ckptd.trainer")

_state: dict[str, float] = {}


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("CKPTD_STEP_REPORT_SECONDS", DEFAULT_REPORT_SECONDS)))
    except ValueError:
        return DEFAULT_REPORT_SECONDS


def report_step(step: int, watch_dir: str | os.PathLike[str] | None = None) -> None:
    """Report that ``step`` is done (module doc); a no-op without a watch dir
    (``CKPTD_WATCH_DIR``, set by ``ckptd exec``) or on a local rank other than 0."""
    now = time.time()
    first = _state.setdefault("first_at", now)
    first_step = int(_state.setdefault("first_step", step))
    if now - _state.get("written_at", float("-inf")) < _interval():
        return
    where = watch_dir if watch_dir is not None else os.environ.get("CKPTD_WATCH_DIR")
    if not where or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    _state["written_at"] = now
    target = Path(where) / STEPS_RELPATH
    body = {
        "step": int(step),
        "at": now,
        "pid": os.getpid(),
        "first_step": first_step,
        "first_at": first,
    }
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".steps.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, target)
    except OSError as exc:
        log.debug("ckptd: cannot report the step: %s", exc)
