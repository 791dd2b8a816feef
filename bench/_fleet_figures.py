"""The fleet campaign's figures, per policy, from the trainer's own logs and the runner's
record of what it did to the cluster; the same logs make the timeline's lanes.

What is read (``load_policy_log``), under ``<dir>/<policy>/``:

- ``node<k>-a<attempt>.jsonl``, one per trainer process (``attempt`` counts node slot
  k's starts from 1), JSON lines with ``t`` (wall seconds) and ``kind``: ``start``
  (``node``, ``attempt``, ``resumed_from``: the step whose checkpoint was loaded, 0 = from
  scratch), ``step`` (``step``: optimizer step n done, 1-based), ``save`` (``step``,
  ``seconds``: the trainer's save of step n returned), ``end`` (``step``, ``digest``:
  sha256 of the final weights);
- ``events.jsonl``, the runner's: ``notice`` (``nodes``, ``provider``), ``gone`` (the
  nodes' processes killed, hosts removed), ``replaced`` (their replacement hosts started);
- ``commits.jsonl``, optional, the runner's: ``{"kind": "commit", "t", "step"}`` when it
  first saw step's checkpoint committed in the store (or, for a sync loop, copied).

A line that is not a JSON object with a numeric ``t`` and a ``kind`` (a process killed
mid-write leaves a truncated last line) is skipped and counted, never fatal; a missing
file is missing data, not an error.

Definitions (each figure is ``None`` where its data is missing):

- **origin**: the earliest ``step`` record of attempt 1 on any node (step s0, normally
  1). The first step's start is not logged; its end is the origin, and goodput counts
  the steps after it.
- **goodput**: ``(end step - s0) / (last end record's t - origin)``, steps per second,
  relative to the uninterrupted run's (which is 1.0 by definition). ``None`` when the job
  did not end.
- **replacement wait**: the seconds from an interruption's ``gone`` to its nodes'
  ``replaced`` (the trace's delay before a new host exists: every policy pays it,
  whatever it does), overlapping spans counted once; **goodput less the wait**: goodput
  over the wall time less that wait, what the policy itself costs.
- **interruption**: one ``gone`` record (or several within 0.5 s: one pool). Its kind is ``reclaim`` when it takes several
  nodes, ``notice`` when a ``notice`` for one of its nodes came since the previous
  ``gone``, else ``kill``.
- **highest step**: the highest step any node reported after the previous interruption's
  ``gone`` and up to this one's (the previous interruption's resumed step when none was).
- **resumed step**: ``resumed_from`` of the first trainer started after ``gone`` on one
  of the interruption's nodes that went on to report a step (else the first started
  there, else the first started anywhere); ``None``: the job never started again.
- **steps lost**: highest step - resumed step (a step done twice is lost; 0 when the job
  resumed at the step it stopped at), never below 0.
- **replacement to first step**: from the last ``replaced`` record of the interruption's
  nodes to the first ``step`` record on one of those nodes after it, seconds.
- **expected step**: the newest step the store had committed before ``gone`` (from
  ``commits.jsonl`` or the ``commits`` argument; 0 when none had been). A resume
  **succeeds** when the resumed step equals it; with no commits known, when the job
  resumed at all and ended. The success rate is over the policy's interruptions.
- **bit-identical**: every ``end`` record's digest equals the uninterrupted run's.

Lanes (``Segment``, seconds since the origin, per node): ``starting`` from a trainer's
start to its first step (restore and start-up), ``stepping`` between two step records
whose later step was kept, ``lost`` where it was done again after an interruption,
``saving`` the trainer's save (``seconds`` before its record; drawn over the rest), and
``down`` from a trainer's last record to the node's next start (node gone and being
replaced, or waiting for one that is).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNINTERRUPTED = "uninterrupted"
KINDS = ("notice", "kill", "reclaim")
_ATTEMPT_FILE = re.compile(r"node(\d+)-a(\d+)\.jsonl")


@dataclass(frozen=True)
class Attempt:
    """One trainer process on one node slot, as its log has it."""

    node: int
    attempt: int
    started: float | None  # the start record's t
    resumed_from: int | None
    steps: tuple[tuple[float, int], ...]  # (t, step), in the order written
    saves: tuple[tuple[float, int, float], ...]  # (t, step, seconds)
    ends: tuple[tuple[float, int, str], ...]  # (t, step, digest)
    first_t: float | None  # the first and the last record's t, of any kind
    last_t: float | None

    @property
    def began(self) -> float | None:
        """When it started: its start record, else its first record."""
        return self.started if self.started is not None else self.first_t


@dataclass(frozen=True)
class ClusterEvent:
    """A line of the runner's ``events.jsonl``."""

    kind: str  # "notice" | "gone" | "replaced"
    t: float
    nodes: tuple[int, ...]
    provider: str | None


@dataclass(frozen=True)
class PolicyLog:
    """Everything read for one policy."""

    policy: str
    attempts: tuple[Attempt, ...]
    events: tuple[ClusterEvent, ...] = ()
    commits: tuple[tuple[float, int], ...] | None = None  # None: no commits.jsonl
    skipped_lines: int = 0


@dataclass(frozen=True)
class Interruption:
    """One ``gone`` and what followed it (module docstring)."""

    kind: str  # "notice" | "kill" | "reclaim"
    provider: str | None
    nodes: tuple[int, ...]
    notice_at: float | None
    gone_at: float
    replaced_at: float | None
    highest_step: int
    resumed_from: int | None
    expected_step: int | None
    lost_steps: int | None
    replace_to_first_step: float | None
    succeeded: bool


@dataclass(frozen=True)
class Segment:
    """A stretch of one node's lane, seconds since the policy's origin."""

    node: int
    state: str  # "starting" | "stepping" | "lost" | "saving" | "down"
    start: float
    end: float


@dataclass(frozen=True)
class Mark:
    """A point on a node's lane: ``notice`` (by provider), ``kill``, ``gone``, ``replaced``."""

    node: int
    kind: str
    at: float  # seconds since the policy's origin
    provider: str | None = None


@dataclass(frozen=True)
class PolicyFigures:
    """One policy's figures (module docstring for each definition)."""

    policy: str
    finished: bool
    steps: int | None  # the job's last step (its end record's)
    wall: float | None  # origin to the last end record, seconds
    steps_per_second: float | None
    goodput: float | None  # relative to the uninterrupted run's
    interruptions: tuple[Interruption, ...]
    resume_success_rate: float | None  # None: no interruption
    digest: str | None  # the final weights' digest when every end record agrees
    bit_identical: bool | None
    attempts: int
    skipped_lines: int
    origin: float | None  # wall time of the origin
    replacement_wait: float = 0.0  # seconds no replacement host existed yet
    goodput_less_wait: float | None = None  # goodput over wall - replacement_wait
    segments: tuple[Segment, ...] = field(default=(), repr=False)
    marks: tuple[Mark, ...] = field(default=(), repr=False)

    @property
    def lost_steps_by_kind(self) -> dict[str, tuple[int, ...]]:
        """Steps lost per interruption, by kind (interruptions that resumed)."""
        return {
            kind: tuple(
                i.lost_steps
                for i in self.interruptions
                if i.kind == kind and i.lost_steps is not None
            )
            for kind in KINDS
        }

    @property
    def replace_to_first_step(self) -> tuple[float, ...]:
        """Seconds from a replacement's start to its first step, per interruption."""
        return tuple(
            i.replace_to_first_step
            for i in self.interruptions
            if i.replace_to_first_step is not None
        )


# --- reading ---------------------------------------------------------------------------


def parse_records(text: str) -> tuple[list[dict[str, Any]], int]:
    """The well-formed records of a JSON-lines text, and how many lines were skipped."""
    records: list[dict[str, Any]] = []
    skipped = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("kind"), str)
            and isinstance(record.get("t"), int | float)
            and not isinstance(record.get("t"), bool)
        ):
            records.append(record)
        else:
            skipped += 1
    return records, skipped


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def attempt_from_records(node: int, attempt: int, records: Iterable[dict[str, Any]]) -> Attempt:
    """One trainer's records as an ``Attempt``; a record missing its fields is left out."""
    started: float | None = None
    resumed: int | None = None
    steps: list[tuple[float, int]] = []
    saves: list[tuple[float, int, float]] = []
    ends: list[tuple[float, int, str]] = []
    times: list[float] = []
    for r in records:
        t = float(r["t"])
        times.append(t)
        step = _int(r.get("step"))
        if r["kind"] == "start" and started is None:
            started, resumed = t, _int(r.get("resumed_from"))
        elif r["kind"] == "step" and step is not None:
            steps.append((t, step))
        elif r["kind"] == "save" and step is not None:
            saves.append((t, step, _float(r.get("seconds")) or 0.0))
        elif r["kind"] == "end" and step is not None and isinstance(r.get("digest"), str):
            ends.append((t, step, r["digest"]))
    return Attempt(
        node,
        attempt,
        started,
        resumed,
        tuple(steps),
        tuple(saves),
        tuple(ends),
        min(times) if times else None,
        max(times) if times else None,
    )


def events_from_records(records: Iterable[dict[str, Any]]) -> tuple[ClusterEvent, ...]:
    """The runner's records as ``ClusterEvent``s in time order; malformed ones left out."""
    out: list[ClusterEvent] = []
    for r in records:
        nodes = r.get("nodes")
        if r["kind"] not in ("notice", "gone", "replaced") or not isinstance(nodes, list):
            continue
        if not all(_int(n) is not None for n in nodes):
            continue
        provider = r.get("provider")
        out.append(
            ClusterEvent(
                r["kind"],
                float(r["t"]),
                tuple(nodes),
                provider if isinstance(provider, str) else None,
            )
        )
    return tuple(sorted(out, key=lambda e: e.t))


def commits_from_records(records: Iterable[dict[str, Any]]) -> tuple[tuple[float, int], ...]:
    """``commits.jsonl`` as (t, step) in time order."""
    found = ((float(r["t"]), _int(r.get("step"))) for r in records if r["kind"] == "commit")
    return tuple(sorted((t, s) for t, s in found if s is not None))


def _read(path: Path) -> tuple[list[dict[str, Any]], int]:
    # A killed writer can leave half a UTF-8 sequence: replaced, then skipped with its line.
    return parse_records(path.read_text(encoding="utf-8", errors="replace"))


def load_policy_log(policy_dir: Path) -> PolicyLog:
    """Read ``<dir>/<policy>/`` (module docstring); what is missing reads as empty."""
    attempts: list[Attempt] = []
    skipped = 0
    for path in sorted(policy_dir.glob("node*-a*.jsonl")):
        match = _ATTEMPT_FILE.fullmatch(path.name)
        if match is None:
            continue
        records, bad = _read(path)
        skipped += bad
        attempts.append(attempt_from_records(int(match[1]), int(match[2]), records))
    events: tuple[ClusterEvent, ...] = ()
    if (policy_dir / "events.jsonl").is_file():
        records, bad = _read(policy_dir / "events.jsonl")
        skipped += bad
        events = events_from_records(records)
    commits: tuple[tuple[float, int], ...] | None = None
    if (policy_dir / "commits.jsonl").is_file():
        records, bad = _read(policy_dir / "commits.jsonl")
        skipped += bad
        commits = commits_from_records(records)
    attempts.sort(key=lambda a: (a.node, a.attempt))
    return PolicyLog(policy_dir.name, tuple(attempts), events, commits, skipped)


def load_campaign(campaign_dir: Path) -> dict[str, PolicyLog]:
    """Every policy's log under the campaign's directory, by policy name."""
    return {d.name: load_policy_log(d) for d in sorted(campaign_dir.iterdir()) if d.is_dir()}


# --- figures ---------------------------------------------------------------------------


def _origin(log: PolicyLog) -> tuple[float, int] | None:
    firsts = [a.steps[0] for a in log.attempts if a.attempt == 1 and a.steps]
    if not firsts:
        firsts = [min(a.steps) for a in log.attempts if a.steps]
    return min(firsts) if firsts else None


def _resumer(log: PolicyLog, nodes: tuple[int, ...], after: float) -> Attempt | None:
    later = sorted(
        (a for a in log.attempts if a.began is not None and a.began > after),
        key=lambda a: a.began or 0.0,
    )
    there = [a for a in later if a.node in nodes]
    for candidates in ([a for a in there if a.steps], there, later):
        if candidates:
            return candidates[0]
    return None


#: ``gone`` records this close together are one event (a pool's nodes, written one by one).
SAME_EVENT_SECONDS = 0.5


def _joined_gones(events: Sequence[ClusterEvent]) -> list[ClusterEvent]:
    out: list[ClusterEvent] = []
    for e in events:
        last = out[-1] if out else None
        if e.kind == "gone" and last and last.kind == "gone" and e.t - last.t < SAME_EVENT_SECONDS:
            nodes = tuple(sorted({*last.nodes, *e.nodes}))
            out[-1] = ClusterEvent("gone", last.t, nodes, last.provider or e.provider)
        else:
            out.append(e)
    return out


def _interruptions(
    log: PolicyLog, commits: Sequence[tuple[float, int]] | None, finished: bool
) -> tuple[Interruption, ...]:
    steps = sorted((t, s, a.node) for a in log.attempts for t, s in a.steps)
    out: list[Interruption] = []
    notices: dict[int, tuple[float, str | None]] = {}
    previous_gone, previous_resumed = float("-inf"), 0
    for event in _joined_gones(log.events):
        if event.kind == "notice":
            for n in event.nodes:
                notices.setdefault(n, (event.t, event.provider))
            continue
        if event.kind != "gone":
            continue
        noticed = [notices[n] for n in event.nodes if n in notices]
        kind = "reclaim" if len(event.nodes) > 1 else ("notice" if noticed else "kill")
        notice_at = min(t for t, _ in noticed) if noticed else None
        provider = next((p for _, p in sorted(noticed, key=lambda x: x[0])), None)
        notices.clear()
        between = [s for t, s, _ in steps if previous_gone < t <= event.t]
        highest = max(between) if between else previous_resumed
        replaced: list[float] = []
        for n in event.nodes:
            first = next(
                (
                    e.t
                    for e in log.events
                    if e.kind == "replaced" and e.t >= event.t and n in e.nodes
                ),
                None,
            )
            if first is not None:
                replaced.append(first)
        replaced_at = max(replaced) if len(replaced) == len(event.nodes) else None
        resumer = _resumer(log, event.nodes, event.t)
        resumed = resumer.resumed_from if resumer is not None else None
        to_step: float | None = None
        if replaced_at is not None:
            first_step = next(
                (t for t, _, n in steps if t > replaced_at and n in event.nodes), None
            )
            to_step = None if first_step is None else first_step - replaced_at
        expected: int | None = None
        if commits is not None:
            expected = max((s for t, s in commits if t <= event.t), default=0)
        succeeded = (
            resumed == expected if expected is not None else resumed is not None and finished
        )
        out.append(
            Interruption(
                kind,
                provider,
                event.nodes,
                notice_at,
                event.t,
                replaced_at,
                highest,
                resumed,
                expected,
                None if resumed is None else max(0, highest - resumed),
                to_step,
                succeeded,
            )
        )
        previous_gone = event.t
        previous_resumed = resumed if resumed is not None else highest
    return tuple(out)


def replacement_wait(interruptions: Iterable[Interruption]) -> float:
    """Seconds from each interruption's ``gone`` to its ``replaced``, overlaps once."""
    total, reach = 0.0, float("-inf")
    spans = sorted((i.gone_at, i.replaced_at) for i in interruptions if i.replaced_at)
    for start, end in spans:
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def _merged(segments: Iterable[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segments:
        if s.end <= s.start:
            continue
        last = out[-1] if out else None
        if last and last.node == s.node and last.state == s.state and last.end == s.start:
            out[-1] = Segment(s.node, s.state, last.start, s.end)
        else:
            out.append(s)
    return out


def _lanes(
    log: PolicyLog, interruptions: Sequence[Interruption], origin: float
) -> tuple[Segment, ...]:
    def lost(t: float, step: int) -> bool:
        hit = next((i for i in interruptions if i.gone_at >= t), None)
        return hit is not None and (hit.resumed_from is None or step > hit.resumed_from)

    out: list[Segment] = []
    for node in sorted({a.node for a in log.attempts}):
        mine = sorted(
            (a for a in log.attempts if a.node == node and a.began is not None),
            key=lambda a: a.began or 0.0,
        )
        lane: list[Segment] = []
        for k, a in enumerate(mine):
            began = (a.began or 0.0) - origin
            if a.steps:
                lane.append(Segment(node, "starting", began, a.steps[0][0] - origin))
                for (t0, _), (t1, step) in zip(a.steps, a.steps[1:], strict=False):
                    state = "lost" if lost(t1, step) else "stepping"
                    lane.append(Segment(node, state, t0 - origin, t1 - origin))
            elif a.last_t is not None:
                lane.append(Segment(node, "starting", began, a.last_t - origin))
            following = mine[k + 1] if k + 1 < len(mine) else None
            if following is not None and a.last_t is not None:
                resumed_at = (following.began or 0.0) - origin
                lane.append(Segment(node, "down", a.last_t - origin, resumed_at))
        out += _merged(lane)
        out += [
            Segment(node, "saving", t - seconds - origin, t - origin)
            for a in mine
            for t, _, seconds in a.saves
            if seconds > 0
        ]
    return tuple(out)


def _marks(
    log: PolicyLog, interruptions: Sequence[Interruption], origin: float
) -> tuple[Mark, ...]:
    kills = {(i.gone_at, i.nodes) for i in interruptions if i.kind == "kill"}
    out: list[Mark] = []
    for e in log.events:
        kind = e.kind
        if kind == "gone" and (e.t, e.nodes) in kills:
            kind = "kill"
        out += [Mark(n, kind, e.t - origin, e.provider) for n in e.nodes]
    return tuple(out)


def policy_figures(
    log: PolicyLog,
    *,
    reference: PolicyFigures | None = None,
    commits: Sequence[tuple[float, int]] | None = None,
) -> PolicyFigures:
    """One policy's figures; ``reference`` is the uninterrupted run's (None: this is it,
    or it is unknown), ``commits`` overrides the log's ``commits.jsonl``."""
    origin = _origin(log)
    ends = [e for a in log.attempts for e in a.ends]
    finished = bool(ends)
    steps = max((s for _, s, _ in ends), default=None)
    wall = rate = None
    if origin is not None and finished and steps is not None:
        wall = max(t for t, _, _ in ends) - origin[0]
        rate = (steps - origin[1]) / wall if wall > 0 else None
    goodput: float | None = None
    if rate is not None:
        if log.policy == UNINTERRUPTED and reference is None:
            goodput = 1.0
        elif reference is not None and reference.steps_per_second:
            goodput = rate / reference.steps_per_second
    interruptions = _interruptions(log, commits if commits is not None else log.commits, finished)
    waited = replacement_wait(interruptions)
    less_wait: float | None = None
    if (
        wall is not None
        and steps is not None
        and origin is not None
        and wall > waited
        and goodput is not None
    ):
        reference_rate = rate if reference is None else reference.steps_per_second
        if reference_rate:
            less_wait = (steps - origin[1]) / (wall - waited) / reference_rate
    success = (
        sum(i.succeeded for i in interruptions) / len(interruptions) if interruptions else None
    )
    digests = {d for _, _, d in ends}
    digest = next(iter(digests)) if len(digests) == 1 else None
    identical: bool | None = None
    if reference is not None and reference.digest is not None and finished:
        identical = digests == {reference.digest}
    elif reference is None and log.policy == UNINTERRUPTED and finished:
        identical = len(digests) == 1
    zero = (
        origin[0]
        if origin is not None
        else min((a.first_t for a in log.attempts if a.first_t is not None), default=0.0)
    )
    return PolicyFigures(
        policy=log.policy,
        finished=finished,
        steps=steps,
        wall=wall,
        steps_per_second=rate,
        goodput=goodput,
        interruptions=interruptions,
        resume_success_rate=success,
        digest=digest,
        bit_identical=identical,
        attempts=len(log.attempts),
        skipped_lines=log.skipped_lines,
        origin=None if origin is None else origin[0],
        replacement_wait=waited,
        goodput_less_wait=less_wait,
        segments=_lanes(log, interruptions, zero),
        marks=_marks(log, interruptions, zero),
    )


def campaign_figures(
    logs: Mapping[str, PolicyLog],
    commits: Mapping[str, Sequence[tuple[float, int]]] | None = None,
) -> dict[str, PolicyFigures]:
    """Every policy's figures against the uninterrupted run's (when it is among them),
    the uninterrupted first, then the rest in the order given."""
    commits = commits or {}
    reference = (
        policy_figures(logs[UNINTERRUPTED], commits=commits.get(UNINTERRUPTED))
        if UNINTERRUPTED in logs
        else None
    )
    out: dict[str, PolicyFigures] = {}
    if reference is not None:
        out[UNINTERRUPTED] = reference
    for name, log in logs.items():
        if name != UNINTERRUPTED:
            out[name] = policy_figures(log, reference=reference, commits=commits.get(name))
    return out
