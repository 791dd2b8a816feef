"""The drill, pure: its stages, its record in the store, its schedule, its success rate.

A drill (docs/preemption.md, "The drill") follows a simulated notice the whole way to a
trainer that loads the checkpoint, and times each stage:

    signalled -> complete -> committed -> restored -> verified -> loaded

The restore-only drill (``ckptd drill --restore-only``, from any node that reaches the
store) runs the last three, and, asked to (``--resume-steps N``), one more: ``resumed``,
the trainer itself started from the restored checkpoint until it reports N steps. Each stage is ``ok``, ``failed``, ``skipped`` (it did not
apply: no process to signal while the trainer saved from its notice file anyway, no load
check configured; said in its detail) or ``not_reached`` (a stage before it failed).
A drill passes only when no stage failed; the first stage that failed is where it failed.

The record (format ``ckptd.drill/1``) is written once per drill beside the run,
``<run>/DRILL.<id>.json`` (``ckptd.repository``), its id the drill's start as a
compact UTC time and the writer, so that a listing is in time order.

The schedule: time is cut into periods of ``every`` seconds from the epoch; each
period's drill is due at a point within its first ``jitter`` share, drawn from a seed
(the run id) and the period, the same on every node. A period's drill is started at the
first look at or after its due time that nothing blocks (a notice, a save in progress,
the advised next save within the margin, a drill already running), and not at all when
its due time passed before the daemon began looking (a daemon started late does not
make up a drill it was not there for).

Invariants: no I/O, no clock (times are arguments); a record that does not parse is no
record (``parse_record`` returns None, never raises).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

FORMAT = "ckptd.drill/1"
STAGES = ("signalled", "complete", "committed", "restored", "verified", "loaded")
RESTORE_STAGES = ("restored", "verified", "loaded")
# The restore-only drill's optional last stage: the trainer resumed for N steps.
RESUME_STAGE = "resumed"
# Every stage a record may hold (one with another is no record).
KNOWN_STAGES = (*STAGES, RESUME_STAGE)
KINDS = ("full", "restore-only")
TRIGGERS = ("schedule", "command")
SUCCESS, FAILURE = "success", "failure"
# A record over this is not one of ours (never parse it).
MAX_RECORD_BYTES = 256 * 1024
MAX_TEXT = 2000
_WRITER_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def compact_time(epoch_seconds: float) -> str:
    """``20261206T135100.123Z``: sorts as the time does, and is safe in a key."""
    moment = datetime.fromtimestamp(epoch_seconds, UTC)
    return moment.strftime("%Y%m%dT%H%M%S.") + f"{moment.microsecond // 1000:03d}Z"


def drill_id(started: float, writer: str) -> str:
    """A drill's id: its start and its writer (the host, made safe for a key)."""
    return f"{compact_time(started)}.{_WRITER_CHARS.sub('_', writer)[:64] or 'node'}"


# -- one drill ------------------------------------------------------------------------------

Status = Literal["ok", "failed", "skipped", "not_reached"]
_STATUS_VALUES: tuple[Status, ...] = ("ok", "failed", "skipped", "not_reached")


@dataclass(frozen=True)
class StageResult:
    """One stage: how it ended, its own duration (None when it did not run), and what a
    person needs to know (the checkpoint, the error, why it was skipped)."""

    stage: str
    status: Status
    seconds: float | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "skipped")


def not_reached(stages: Sequence[str]) -> list[StageResult]:
    """The stages after a failure: none of them ran."""
    return [StageResult(name, "not_reached") for name in stages]


@dataclass(frozen=True)
class DrillRecord:
    """One drill, as its record in the store holds it."""

    run_id: str
    drill_id: str
    kind: str  # full | restore-only
    trigger: str  # schedule | command
    node: str
    started: float  # wall clock
    finished: float
    stages: tuple[StageResult, ...]
    checkpoint: str | None = None
    total_bytes: int = 0
    error: str = ""  # the failed stage's one line
    period: float | None = None  # a scheduled drill's period (its start)
    deadline_seconds: float | None = None

    @property
    def failed_stage(self) -> str | None:
        return next((s.stage for s in self.stages if s.status == "failed"), None)

    @property
    def result(self) -> str:
        return SUCCESS if self.failed_stage is None else FAILURE

    def timings(self) -> list[dict[str, Any]]:
        """Each stage with its own seconds and the seconds since the drill began at its
        end (``after_s``; None for a stage that did not run)."""
        out, after = [], 0.0
        for s in self.stages:
            if s.seconds is not None:
                after += round(s.seconds, 3)  # so a record read back sums as it was written
            out.append(
                {
                    "stage": s.stage,
                    "status": s.status,
                    "seconds": None if s.seconds is None else round(s.seconds, 3),
                    "after_s": None if s.seconds is None else round(after, 3),
                    "detail": s.detail,
                }
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "id": self.drill_id,
            "kind": self.kind,
            "trigger": self.trigger,
            "node": self.node,
            "started": round(self.started, 3),
            "finished": round(self.finished, 3),
            "checkpoint": self.checkpoint,
            "bytes": self.total_bytes,
            "result": self.result,
            "failed_stage": self.failed_stage,
            "error": self.error,
            "period": self.period,
            "deadline_seconds": self.deadline_seconds,
            "stages": self.timings(),
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True).encode()


def _text(doc: dict[str, Any], key: str, limit: int = 256) -> str | None:
    value = doc.get(key)
    return value if isinstance(value, str) and len(value) <= limit else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def _stage(doc: Any) -> StageResult | None:
    if not isinstance(doc, dict):
        return None
    name, raw = _text(doc, "stage"), doc.get("seconds")
    status = next((s for s in _STATUS_VALUES if s == doc.get("status")), None)
    seconds = None if raw is None else _number(raw)
    if name not in KNOWN_STAGES or status is None or (raw is not None and seconds is None):
        return None
    return StageResult(name, status, seconds, _text(doc, "detail", MAX_TEXT) or "")


def parse_record(body: bytes) -> DrillRecord | None:
    """A ``ckptd.drill/1`` record, or None for anything else (never raises)."""
    if len(body) > MAX_RECORD_BYTES:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    run_id, rid, node = _text(doc, "run_id"), _text(doc, "id"), _text(doc, "node")
    kind, trigger = _text(doc, "kind"), _text(doc, "trigger")
    started, finished = _number(doc.get("started")), _number(doc.get("finished"))
    raw = doc.get("stages")
    if (
        not run_id
        or not rid
        or node is None
        or kind not in KINDS
        or trigger not in TRIGGERS
        or started is None
        or finished is None
        or not isinstance(raw, list)
    ):
        return None
    stages = [_stage(s) for s in raw]
    if not stages or any(s is None for s in stages):
        return None
    size = doc.get("bytes")
    return DrillRecord(
        run_id=run_id,
        drill_id=rid,
        kind=kind,
        trigger=trigger,
        node=node,
        started=started,
        finished=finished,
        stages=tuple(s for s in stages if s is not None),
        checkpoint=_text(doc, "checkpoint"),
        total_bytes=size
        if isinstance(size, int) and not isinstance(size, bool) and size >= 0
        else 0,
        error=_text(doc, "error", MAX_TEXT) or "",
        period=_number(doc.get("period")),
        deadline_seconds=_number(doc.get("deadline_seconds")),
    )


# -- the run's drills -----------------------------------------------------------------------


@dataclass(frozen=True)
class DrillSummary:
    """A run's last drills, of every kind: how many passed, the last one, and when the
    last success and the last failure among them were (None: none among them); and of
    those that asked the trainer to resume (a ``resumed`` stage), how many passed and when
    the last of them that passed ended."""

    drills: int
    passed: int
    last: DrillRecord | None
    last_success: float | None
    last_failure: float | None
    resumes: int = 0
    resumes_passed: int = 0
    last_resume_success: float | None = None

    @property
    def rate(self) -> float | None:
        return None if self.drills == 0 else self.passed / self.drills

    @property
    def resume_rate(self) -> float | None:
        return None if self.resumes == 0 else self.resumes_passed / self.resumes

    def to_json(self) -> dict[str, Any]:
        return {
            "drills": self.drills,
            "passed": self.passed,
            "success_rate": None if self.rate is None else round(self.rate, 4),
            "last_success": self.last_success,
            "last_failure": self.last_failure,
            "resumes": self.resumes,
            "resumes_passed": self.resumes_passed,
            "resume_success_rate": None if self.resume_rate is None else round(self.resume_rate, 4),
            "last_resume_success": self.last_resume_success,
            "last": None if self.last is None else self.last.to_json(),
        }


def asked_to_resume(record: DrillRecord) -> bool:
    """Whether the drill asked the trainer to resume from what it restored."""
    return any(s.stage == RESUME_STAGE for s in record.stages)


def summarize(records: Sequence[DrillRecord], last: int) -> DrillSummary:
    """The summary of the ``last`` newest of ``records`` (any order)."""
    recent = sorted(records, key=lambda r: (r.started, r.drill_id))[-last:] if last > 0 else []
    passed = [r for r in recent if r.result == SUCCESS]
    failed = [r for r in recent if r.result == FAILURE]
    resumes = [r for r in recent if asked_to_resume(r)]
    resumed = [r for r in resumes if r.result == SUCCESS]
    return DrillSummary(
        drills=len(recent),
        passed=len(passed),
        last=recent[-1] if recent else None,
        last_success=max((r.finished for r in passed), default=None),
        last_failure=max((r.finished for r in failed), default=None),
        resumes=len(resumes),
        resumes_passed=len(resumed),
        last_resume_success=max((r.finished for r in resumed), default=None),
    )


# -- the schedule -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """Periods of ``every`` seconds from the epoch, each with its due time (module doc)."""

    every: float
    jitter: float
    seed: str

    def period_of(self, now: float) -> float:
        """The start of the period holding ``now``."""
        return math.floor(now / self.every) * self.every

    def due(self, period: float) -> float:
        """When the drill of the period starting at ``period`` is due."""
        digest = hashlib.sha256(f"{self.seed}\0{period:.3f}".encode()).digest()
        fraction = int.from_bytes(digest[:8], "big") / 2**64
        return period + fraction * self.jitter * self.every


@dataclass(frozen=True)
class Look:
    """What the scheduler does at one look: ``wait`` until ``next_look``, ``skip`` (due,
    but ``reason`` blocks it; look again at ``next_look``), or ``drill`` now."""

    action: Literal["wait", "skip", "drill"]
    period: float
    due: float
    next_look: float
    reason: str = ""


def decide(
    schedule: Schedule,
    now: float,
    *,
    since: float,
    handled: float | None,
    blocked: str | None,
    retry: float,
) -> Look:
    """The scheduler's decision at ``now`` (module doc): ``since`` is when it began
    looking, ``handled`` the last period it drilled in (or found drilled by another node),
    ``blocked`` what stops a drill now (None: nothing), ``retry`` how soon a skipped drill
    is looked at again."""
    period = schedule.period_of(now)
    due = schedule.due(period)
    if handled == period or due < since:
        following = period + schedule.every
        return Look("wait", following, schedule.due(following), schedule.due(following))
    if now < due:
        return Look("wait", period, due, due)
    if blocked is not None:
        return Look("skip", period, due, now + retry, blocked)
    return Look("drill", period, due, now)


def hold_seconds(schedule: Schedule, due: float, most: float) -> float:
    """How long past ``due`` a save may hold a period's drill back: ``most``, and never
    more than halfway from ``due`` to the period's end (so the drill starts inside it)."""
    end = schedule.period_of(due) + schedule.every
    return max(0.0, min(most, (end - due) / 2))


def blocked_reason(
    now: float,
    *,
    due: float,
    notice: str | None,
    saving: bool,
    next_save_at: float | None,
    last_routine_save: float | None,
    margin: float,
    hold: float,
    drilling: bool,
) -> str | None:
    """Why a scheduled drill due at ``due`` may not start at ``now``, or None.

    A drill already running and an active notice (``notice`` names it) block it. A save
    in progress and the run's advised next save less than ``margin`` seconds before or
    after ``now`` hold it back, but only while ``now`` is less than ``hold`` seconds past
    ``due``; and the margin only until a routine save committed at or after ``due``
    (``last_routine_save``): right after one the drill starts, whatever the interval."""
    if drilling:
        return "a drill is running"
    if notice is not None:
        return f"a notice is active ({notice})"
    if now - due >= hold:
        return None
    if saving:
        return "a save is in progress"
    if last_routine_save is not None and last_routine_save >= due:
        return None
    if next_save_at is not None and abs(next_save_at - now) < margin:
        return f"the advised next save is due within {margin:g} s"
    return None


def advised_next_save(last_routine_save: float | None, interval: float) -> float | None:
    """When the run's next routine save is expected: its last one plus the advised
    interval (None before any routine save was seen)."""
    return None if last_routine_save is None else last_routine_save + interval


@dataclass
class SkipLog:
    """Which period's drill was said to be held back, so each due time is logged once,
    however often the reason changes while it waits."""

    said: set[float] = field(default_factory=set)

    def first(self, period: float) -> bool:
        """Whether ``period``'s skip is unsaid (and remember it)."""
        if period in self.said:
            return False
        self.said = {period}
        return True


__all__ = [
    "FAILURE",
    "FORMAT",
    "RESTORE_STAGES",
    "RESUME_STAGE",
    "STAGES",
    "SUCCESS",
    "DrillRecord",
    "DrillSummary",
    "Look",
    "Schedule",
    "SkipLog",
    "StageResult",
    "advised_next_save",
    "asked_to_resume",
    "blocked_reason",
    "compact_time",
    "decide",
    "drill_id",
    "hold_seconds",
    "not_reached",
    "parse_record",
    "summarize",
]
