"""The run ledger and goodput, pure: records in, time by cause out.

The ledger (format ``ckptd.goodput/1``, docs/design.md "Run ledger (contract)") is a set of
immutable records, each with an ``id`` unique in the run (``<writer>:<seq>``). Writers
only ever append; readers take the union and keep one record per id
(``merge_records``). So a chunk written twice (a writer killed between shipping it and
noting that it did) counts once, and a chunk never shipped costs its records, nothing else.

Two kinds of record:
- an ``Interval``: a node spent ``[start, end)`` on ``cause`` (``CAUSES``), with the
  ``basis`` it was measured on and, for training, the steps ``[step_from, step_to]``;
  a restore's carries where its bytes came from (``{"peer": N, "store": N}``: the
  store's egress for it), when the writer knew;
- a ``Mark``: something happened at ``at`` (``MARKS``: a notice, a commit, an
  interruption, the run's end, a writer's stop, an emergency checkpoint safe off the
  node, with ``peer:``/``store:`` and the checkpoint as its detail), drawn on the
  timeline, counted in the report.

A record's ``attempt`` is one trainer start, ``<writer>/<n>``, or the writer itself for
what happens before its first start: ``attempts`` counts trainer starts only.

Intervals may overlap: a later record can say that time first recorded as productive was
lost (its steps are re-done after a restore). At each instant the run's cause is the one
of highest precedence (``PRECEDENCE``) among all intervals of all nodes covering it (one
stalled node stalls a synchronous run); an instant no interval covers is ``unknown``. So
the causes tile the wall time exactly: they sum to it, by construction.

The wall time ends where the run ended (``run_end``): at its ``finished`` mark (unless
training went on after it), else, for a reader who passes ``now``, at ``now`` while a
writer may still be recording (it has not marked ``stopped`` and its last record is less
than ``ABANDONED_SECONDS`` old), else at the run's last record: a run that stopped or was
abandoned stops accruing ``unknown``.

Invariants: no I/O, no clock (``now`` is an argument); unknown is never zero-filled.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

FORMAT = "ckptd.goodput/1"
# Highest precedence first: where intervals overlap, the first cause here wins. A drill
# (``ckptd exec``: from its notice until the trainer it stopped is started again) is its
# own cause, over the save and the restart inside it: neither lost time nor a preemption.
PRECEDENCE = ("drill", "save", "wait_commit", "restore", "startup", "lost", "productive", "down")
CAUSES = frozenset(PRECEDENCE)
UNKNOWN = "unknown"  # time no record covers: never recorded, only derived
BADPUT_CAUSES = (*tuple(c for c in PRECEDENCE if c != "productive"), UNKNOWN)
# "stopped": the writer (one ckptd exec, one ckptd run) stopped recording.
MARKS = frozenset({"notice", "commit", "interrupted", "finished", "stopped", "safe"})


def notice_cause(source: str) -> str:
    """The cause of an attempt a notice from ``source`` interrupted (an ``interrupted``
    mark's detail): ``health`` for a health ``save-and-stop`` (source ``health``, or
    ``node-N/health`` followed from another node), else ``notice``. Readers take any
    detail: a ledger written before ``health`` reads as it did."""
    return "health" if source == "health" or source.endswith("/health") else "notice"


MAX_TEXT = 128
# A chunk over this is not a ledger chunk (never parse it).
MAX_CHUNK_BYTES = 4 * 1024 * 1024
DAY_SECONDS = 86400.0
# A writer without a "stopped" mark whose last record is older than this is taken for gone
# (killed with its node): the run it wrote no longer accrues unknown time. Ten minutes: a
# live writer ships every 15 s, but journals nothing while its trainer starts up or
# waits to be restarted.
ABANDONED_SECONDS = 600.0


@dataclass(frozen=True)
class Interval:
    id: str
    node: str
    attempt: str
    cause: str
    start: float
    end: float
    basis: str
    step_from: int | None = None
    step_to: int | None = None
    peer_bytes: int | None = None  # a restore's: read from other nodes
    store_bytes: int | None = None  # a restore's: read from the store

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict[str, Any]:
        sources = (
            {}
            if self.peer_bytes is None or self.store_bytes is None
            else {"bytes": {"peer": self.peer_bytes, "store": self.store_bytes}}
        )
        return {
            "id": self.id,
            "type": "interval",
            "node": self.node,
            "attempt": self.attempt,
            "cause": self.cause,
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "basis": self.basis,
            "steps": None if self.step_from is None else [self.step_from, self.step_to],
            **sources,
        }


@dataclass(frozen=True)
class Mark:
    id: str
    node: str
    attempt: str
    kind: str
    at: float
    detail: str = ""
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "mark",
            "node": self.node,
            "attempt": self.attempt,
            "kind": self.kind,
            "at": round(self.at, 3),
            "detail": self.detail,
            "step": self.step,
        }


Record = Interval | Mark


def _text(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    return value if isinstance(value, str) and len(value) <= MAX_TEXT else None


def _time(doc: dict[str, Any], key: str) -> float | None:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_record(doc: Any) -> Record | None:
    """One record, or None when it is not a valid one (skipped, never an error)."""
    if not isinstance(doc, dict):
        return None
    rid, node, attempt = _text(doc, "id"), _text(doc, "node"), _text(doc, "attempt")
    if not rid or node is None or attempt is None:
        return None
    if doc.get("type") == "interval":
        cause, basis = _text(doc, "cause"), _text(doc, "basis")
        start, end = _time(doc, "start"), _time(doc, "end")
        if cause not in CAUSES or basis is None or start is None or end is None or end < start:
            return None
        steps = doc.get("steps")
        lo = hi = None
        if isinstance(steps, list) and len(steps) == 2:
            lo, hi = _step(steps[0]), _step(steps[1])
            if lo is None or hi is None or hi < lo:
                lo = hi = None
        sources = doc.get("bytes")
        peer = store = None
        if isinstance(sources, dict):
            peer, store = _step(sources.get("peer")), _step(sources.get("store"))
            if peer is None or store is None:
                peer = store = None
        return Interval(rid, node, attempt, cause, start, end, basis, lo, hi, peer, store)
    if doc.get("type") == "mark":
        kind, at = _text(doc, "kind"), _time(doc, "at")
        if kind not in MARKS or at is None:
            return None
        return Mark(
            rid, node, attempt, kind, at, _text(doc, "detail") or "", _step(doc.get("step"))
        )
    return None


def chunk_bytes(run_id: str, writer: str, records: Sequence[Record]) -> bytes:
    """One chunk of the ledger as the store holds it."""
    doc = {
        "format": FORMAT,
        "run_id": run_id,
        "writer": writer,
        "records": [r.to_json() for r in records],
    }
    return json.dumps(doc, sort_keys=True).encode()


def parse_chunk(body: bytes) -> list[Record]:
    """A chunk's valid records; [] for anything that is not a ``ckptd.goodput/1`` chunk."""
    if len(body) > MAX_CHUNK_BYTES:
        return []
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return []
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return []
    records = doc.get("records")
    if not isinstance(records, list):
        return []
    return [r for r in (parse_record(d) for d in records) if r is not None]


def merge_records(*groups: Iterable[Record]) -> list[Record]:
    """The union of ``groups``, one record per id (the first seen), in time order."""
    seen: dict[str, Record] = {}
    for group in groups:
        for record in group:
            seen.setdefault(record.id, record)
    return sorted(seen.values(), key=lambda r: (r.start if isinstance(r, Interval) else r.at, r.id))


# -- the timeline ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    cause: str
    start: float
    end: float


def timeline(intervals: Sequence[Interval], start: float, end: float) -> list[Segment]:
    """``[start, end)`` cut into segments by cause (module doc: precedence, unknown),
    adjacent segments of one cause joined. One sweep over the intervals' ends, sorted:
    O(n log n), so a week-long run's ledger (tens of thousands of spans) is read in well
    under a second."""
    if end <= start:
        return []
    rank = {c: i for i, c in enumerate(PRECEDENCE)}
    events: list[tuple[float, int, int]] = []  # (time, +1 covers from / -1 no more, rank)
    for iv in intervals:
        lo, hi = max(iv.start, start), min(iv.end, end)
        if hi > lo:
            events += [(lo, 1, rank[iv.cause]), (hi, -1, rank[iv.cause])]
    events.sort(key=lambda e: e[0])
    covering = [0] * len(PRECEDENCE)
    out: list[Segment] = []
    cursor, k = start, 0
    while cursor < end:
        while k < len(events) and events[k][0] <= cursor:
            covering[events[k][2]] += events[k][1]
            k += 1
        upto = min(events[k][0], end) if k < len(events) else end
        cause = next((PRECEDENCE[i] for i, n in enumerate(covering) if n > 0), UNKNOWN)
        if out and out[-1].cause == cause:
            out[-1] = Segment(cause, out[-1].start, upto)
        else:
            out.append(Segment(cause, cursor, upto))
        cursor = upto
    return out


@dataclass(frozen=True)
class Interruption:
    """One interruption of an attempt, as the ledger shows it."""

    at: float
    node: str
    attempt: str
    cause: str  # the mark's detail: notice, signal:SIGKILL, exit:1 ...
    lost_steps: int | None  # None: unknown (no step report)
    lost_seconds: float


@dataclass
class Goodput:
    """Time by cause over ``[start, end)``: ``seconds`` sums to ``wall``."""

    start: float
    end: float
    seconds: dict[str, float] = field(default_factory=dict)
    attempts: int = 0
    nodes: int = 0
    interruptions: list[Interruption] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def ratio(self) -> float | None:
        """Productive over wall; None before any time has passed."""
        return self.seconds.get("productive", 0.0) / self.wall if self.wall > 0 else None

    @property
    def without_steps(self) -> bool:
        """Time passed and none of it productive: the trainer reported no step
        (``ckptd.trainer.report_step``), so its time counts as startup."""
        return self.wall > 0 and self.seconds.get("productive", 0.0) == 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "wall_seconds": round(self.wall, 3),
            "goodput_ratio": None if self.ratio is None else round(self.ratio, 4),
            "no_step_reports": self.without_steps,
            "seconds": {c: round(s, 3) for c, s in sorted(self.seconds.items())},
            "attempts": self.attempts,
            "nodes": self.nodes,
            "interruptions": len(self.interruptions),
            "lost_steps": sum(i.lost_steps or 0 for i in self.interruptions),
        }


def span(records: Sequence[Record]) -> tuple[float, float] | None:
    """The first and last instants of the run the ledger records (None: empty). A
    ``stopped`` mark says when a writer stopped recording, not what the run did: it is
    not counted (so a run does not end, nor a later writer's gap begin, at a writer's
    exit)."""
    times = [
        t
        for r in records
        if not (isinstance(r, Mark) and r.kind == "stopped")
        for t in ((r.start, r.end) if isinstance(r, Interval) else (r.at,))
    ]
    return (min(times), max(times)) if times else None


def writer_of(record: Record) -> str:
    """The writer that journaled ``record`` (its id is ``<writer>:<n>``)."""
    return record.id.rpartition(":")[0]


def is_trainer_attempt(attempt: str) -> bool:
    """Whether ``attempt`` is a trainer start (``<writer>/<n>``), not a writer's time
    before its first start."""
    return "/" in attempt


def finished_at(records: Sequence[Record]) -> float | None:
    """When the run finished: its last ``finished`` mark, unless training went on after
    it (a run resumed for more steps); None when it has not."""
    marks = [r.at for r in records if isinstance(r, Mark) and r.kind == "finished"]
    if not marks:
        return None
    at = max(marks)
    went_on = any(isinstance(r, Interval) and r.start > at for r in records)
    return None if went_on else at


def recording(records: Sequence[Record], now: float) -> bool:
    """Whether a writer may still be recording the run at ``now``: one that has not marked
    ``stopped`` and whose last record is less than ``ABANDONED_SECONDS`` old."""
    last: dict[str, float] = {}
    stopped: set[str] = set()
    for r in records:
        writer = writer_of(r)
        at = r.end if isinstance(r, Interval) else r.at
        last[writer] = max(at, last.get(writer, at))
        if isinstance(r, Mark) and r.kind == "stopped":
            stopped.add(writer)
    return any(now - at < ABANDONED_SECONDS for w, at in last.items() if w not in stopped)


def run_end(records: Sequence[Record], now: float | None = None) -> float | None:
    """Where the run's wall time ends (module doc); None for an empty ledger."""
    bounds = span(records)
    if bounds is None:
        return None
    done = finished_at(records)
    if done is not None:
        return done  # the run ended there; what follows (its last upload) is not it
    if now is not None and recording(records, now):
        return max(now, bounds[1])
    return bounds[1]


def goodput(
    records: Sequence[Record],
    *,
    now: float | None = None,
    until: float | None = None,
    since: float | None = None,
) -> Goodput:
    """Time by cause from the run's first record (or ``since``, if later) to its end
    (``run_end``: a reader passes ``now``) or to ``until`` (a writer that is recording
    the run passes its now: it knows the run goes on), and its interruptions."""
    intervals = [r for r in records if isinstance(r, Interval)]
    bounds = span(records)
    if bounds is None:
        return Goodput(0.0, 0.0)
    start = bounds[0]
    done = finished_at(records)
    if until is not None and done is None:
        end = max(until, start)
    else:
        end = run_end(records, now) or start
    if since is not None:
        start = min(max(since, start), end)
    result = Goodput(start, end, {c: 0.0 for c in (*PRECEDENCE, UNKNOWN)})
    for seg in timeline(intervals, start, end):
        result.seconds[seg.cause] += seg.end - seg.start
    inside = [iv for iv in intervals if iv.end > start and iv.start < end] if since else intervals
    result.attempts = len(
        {(iv.node, iv.attempt) for iv in inside if is_trainer_attempt(iv.attempt)}
    )
    result.nodes = len({iv.node for iv in inside})
    result.interruptions = interruptions(records, start, end)
    return result


def interruptions(records: Sequence[Record], start: float, end: float) -> list[Interruption]:
    """Each ``interrupted`` mark in ``[start, end]`` with the lost interval that names the
    same node and attempt (its steps and seconds)."""
    lost = {
        (r.node, r.attempt): r for r in records if isinstance(r, Interval) and r.cause == "lost"
    }
    out = []
    for r in records:
        if isinstance(r, Mark) and r.kind == "interrupted" and start <= r.at <= end:
            iv = lost.get((r.node, r.attempt))
            steps = None
            if iv is not None and iv.step_from is not None and iv.step_to is not None:
                steps = iv.step_to - iv.step_from
            elif iv is None and r.step is not None:
                steps = 0
            out.append(
                Interruption(r.at, r.node, r.attempt, r.detail, steps, iv.seconds if iv else 0.0)
            )
    return out


# -- lost progress --------------------------------------------------------------------------


def time_at_step(samples: Sequence[tuple[float, int]], step: int) -> float | None:
    """When ``step`` was reached, from ``(time, step)`` samples in time order: exact at a
    sample, linear between two, None when outside the samples."""
    for (t0, s0), (t1, s1) in itertools.pairwise(samples):
        if s0 <= step <= s1:
            if s1 == s0:
                return t0
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    if samples and samples[0][1] == step:
        return samples[0][0]
    return None


def lost_span(
    samples: Sequence[tuple[float, int]], resumed_step: int, ended_at: float
) -> tuple[float, int, int] | None:
    """The progress an attempt lost when its successor resumed at ``resumed_step``:
    ``(since, resumed_step, last_step)`` (from the time that step was reached to the
    attempt's end), or None when nothing was lost or the samples cannot say."""
    if not samples:
        return None
    last_step = samples[-1][1]
    if last_step <= resumed_step:
        return None
    since = time_at_step(samples, resumed_step)
    if since is None:  # resumed before the first sample: lost since the first one
        since = samples[0][0] if resumed_step < samples[0][1] else None
    if since is None or since >= ended_at:
        return None
    return since, resumed_step, last_step


__all__ = [
    "ABANDONED_SECONDS",
    "BADPUT_CAUSES",
    "CAUSES",
    "DAY_SECONDS",
    "FORMAT",
    "MARKS",
    "PRECEDENCE",
    "UNKNOWN",
    "Goodput",
    "Interruption",
    "Interval",
    "Mark",
    "Record",
    "Segment",
    "chunk_bytes",
    "finished_at",
    "goodput",
    "interruptions",
    "is_trainer_attempt",
    "lost_span",
    "merge_records",
    "notice_cause",
    "parse_chunk",
    "parse_record",
    "recording",
    "run_end",
    "span",
    "time_at_step",
    "timeline",
    "writer_of",
]
