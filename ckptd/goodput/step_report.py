"""The daemon's side of the trainer's step report (``ckptd.trainer.report_step``): where the
trainer is, read from ``<watch dir>/.ckptd/steps.bin`` (the step counter,
``ckptd.core.handoff.StepCounterLayout``), else from ``steps.json`` (the helpers' fallback
where the counter cannot be mapped); and the losses reported with the steps, from the loss
ring ``losses.bin`` (``ckptd.core.handoff.LossRingLayout``, ``read_losses``).

Invariant: a report is believed only when whole: a counter slot is taken when two reads
in a row agree (a read torn by the trainer's concurrent write is retried a few times,
then given up for this poll); a JSON report must parse with integer steps and numeric
times. Reading never writes the watch dir.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ckptd.core.handoff import (
    LOSS_LAYOUT,
    LOSSES,
    STEP_COUNTER,
    STEP_LAYOUT,
    STEPS,
    LossReport,
    StepRecord,
)

STEP_COUNTER_RELPATH = STEP_COUNTER
STEPS_RELPATH = STEPS
# Reads of the counter before a poll gives up on a slot that keeps changing under it.
READ_TRIES = 5

__all__ = [
    "STEPS_RELPATH",
    "STEP_COUNTER_RELPATH",
    "LossReport",
    "StepRecord",
    "StepReports",
    "read_json_loss",
    "read_losses",
    "read_steps",
]


@dataclass(frozen=True)
class StepReports:
    """The newest report (``current``) and, from the counter, the last report of the
    process that reported before it (``previous``); either may be None."""

    current: StepRecord | None
    previous: StepRecord | None = None


def _read_counter(path: Path) -> StepReports:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return StepReports(None)
    try:
        slots: list[StepRecord | None] = [None, None]
        for index in (0, 1):
            for _ in range(READ_TRIES):
                first = os.pread(fd, STEP_LAYOUT.SIZE, 0)
                again = os.pread(fd, STEP_LAYOUT.SIZE, 0)
                one, two = STEP_LAYOUT.decode(first, index), STEP_LAYOUT.decode(again, index)
                if one == two:
                    slots[index] = one
                    break
        return StepReports(slots[0], slots[1])
    except OSError:
        return StepReports(None)
    finally:
        os.close(fd)


def _read_json(path: Path) -> StepRecord | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    step, at = _int(doc.get("step")), _number(doc.get("at"))
    if step is None or at is None:
        return None
    first_step, first_at = _int(doc.get("first_step")), _number(doc.get("first_at"))
    if first_step is None or first_at is None:
        first_step, first_at = step, at  # an older helper: its first report is this one
    return StepRecord(step, at, _int(doc.get("pid")) or 0, first_step, first_at)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None  # type: ignore[arg-type]


def read_steps(watch_dir: Path) -> StepReports:
    """What the trainer last reported in ``watch_dir`` (module doc): the counter's, unless
    ``steps.json`` is newer (a helper that fell back to it, or an older helper)."""
    counter = _read_counter(watch_dir / STEP_COUNTER_RELPATH)
    fallback = _read_json(watch_dir / STEPS_RELPATH)
    if fallback is not None and (counter.current is None or fallback.at > counter.current.at):
        return StepReports(fallback, counter.current)
    return counter


def read_losses(watch_dir: Path, after: int) -> tuple[list[LossReport], int]:
    """The losses reported in ``watch_dir`` after report ``after`` (oldest first) and the
    count to pass next time (``LossRingLayout.decode``); none without a ring."""
    try:
        data = (watch_dir / LOSSES).read_bytes()
    except OSError:
        return [], after
    return LOSS_LAYOUT.decode(data, after)


def read_json_loss(watch_dir: Path) -> LossReport | None:
    """The fallback's last loss (``steps.json``'s optional ``loss``, ``"nan"``, ``"inf"``
    or ``"-inf"`` as text), as a report numbered by its time; None without one. Sampled:
    the helper replaces the file at most every few seconds."""
    try:
        doc = json.loads((watch_dir / STEPS_RELPATH).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    loss = doc.get("loss")
    loss = float(loss) if loss in ("nan", "inf", "-inf") else _number(loss)
    step, at = _int(doc.get("step")), _number(doc.get("at"))
    if step is None or at is None or loss is None:
        return None
    return LossReport(int(at * 1e6), step, loss)
