"""Checkpoint cadence: how often to save, from what a save costs and how often the run
is interrupted. Pure: records and time in, advice out.

The model (Young 1974, Daly 2006). Training alternates ``T`` seconds of work with a save
that blocks it for ``C`` seconds; interruptions arrive at random, ``M`` seconds apart on
average. Each save costs ``C``; each interruption throws away the work since the last
durable checkpoint, on average half a cycle plus the upload time ``U`` (a checkpoint still
being uploaded is lost with the node). The fraction of time lost is

    C / (T + C)  +  ((T + C) / 2 + U) / M

and the ``T`` that minimises it is, to first order, Young's ``sqrt(2 C M) - C``. The
advice uses Daly's higher-order form

    T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C        for C < 2M

which agrees with Young's as C/M -> 0 and is closer to the true optimum when saves are
slow against the interruption rate. Daly takes ``T = M`` for C >= 2M; here the formula's
own value there, ``8M/9``, keeps the advice continuous and monotone in both C and M (at
C >= 2M a run loses most of its time whatever it does; the advice only has to be sane).

Edges: C = 0 (nothing measured yet, or saves that cost nothing) gives T = 0, which no
one wants: ``min_interval`` bounds it below, ``max_interval`` above, and the upload time
too, since saving faster than the uploader ships makes a queue, not durability.

``M`` is learned from the run's interruptions (notices, restarts under ``ckptd exec``,
restores onto a fresh node), recorded under the run in the store. One preemption is seen
several ways (its notice, the restart it causes, the restore on the next node, each
node's own notice): records within ``MERGE_SECONDS`` of a counted one are the same
interruption. The estimate is the posterior mean of a Gamma prior worth ``PRIOR_WEIGHT``
interruptions over ``prior_mtbf`` seconds: ``(observed + w * prior) / (count + w)``, so a
new run starts at the prior and its own history takes over as it grows.

Other runs. A run's own interruptions are few (a run preempted weekly sees eight in two
months), and a new run has none, while the rate is mostly the fleet's: the same
instance types in the same zones. So the estimate also counts the history the store
keeps for the other runs under the same destination (their ``<run>/CADENCE``, read at
start-up and hourly; ``[cadence] learn_from_other_runs``): their observed time and their
costly interruptions join the run's own, ``(observed + others' + w * prior) / (count +
others' + w)``. A run whose rate differs from the fleet's moves away from it as its own
history grows; one that should not share sets ``learn_from_other_runs = false`` (or
``mtbf_hours``).

After a restart (bursts). Where preemptions come in bursts (a zone out of capacity takes
the replacement node too), the next interruption is likely soon after a restart, and the
work since the restart is lost whatever the interval. The run's own history says how
likely: of its ``n`` distinct interruptions, ``k`` were followed within one interval by
another (quick repeats, mean gap ``g``). Taking a restart to be followed by such a repeat
with probability ``p = k / n`` (each of the ``n - 1`` gaps an observation, plus one
pseudo-observation of no repeat, so a run that has seen none never saves early), at an
exponential gap of mean ``g``, a first save after ``tau`` seconds of work keeps ``tau``
when the repeat comes after that save is durable: ``p tau exp(-(tau + C + U) / g)``,
largest at ``tau = g``. It costs one save, ``C``. So the first save after a restart comes
after ``g`` when ``p g exp(-1 - (C + U) / g) > C``, else after the usual interval; the
interval counts from that save as from any other. Under Poisson interruptions quick
repeats are rare (``p`` ~ T/M) and the rule stays off.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

HISTORY_FORMAT = "ckptd.cadence/1"
# Records within this many seconds of a counted interruption are the same one.
MERGE_SECONDS = 600.0
# The prior counts as this many interruptions seen over this many of its MTBFs.
# Half an interruption (the shape of Jeffreys' prior for a Poisson rate) is a vague
# prior: a run's first interruption or two outweigh it. Its mean, 24 h, is the pessimistic
# end of what clouds publish: GCP's preemptible VMs stop after at most 24 h (Spot VMs have
# no limit; docs.cloud.google.com/compute/docs/instances/create-use-preemptible), while
# AWS's Spot Instance Advisor puts each instance type in a band of the share of its
# capacity reclaimed over the trailing month (<5 %, 5-10 %, 10-15 %, 15-20 %, >20 %),
# months per node for most types, and a job of N nodes sees N times a node's rate. No
# published figure tells one run's rate, so the prior errs toward saving too often, which
# costs a new run less than erring the other way. (In bench/bench_cadence.py a prior at
# the true rate gains under a point on the weekly Poisson trace, while a 168 h prior costs
# the hourly ones two: docs/cadence.md and docs/benchmarks.md.)
PRIOR_WEIGHT = 0.5
DEFAULT_PRIOR_MTBF_SECONDS = 24 * 3600.0
# The save cost and upload time are the median of this many recent saves.
RECENT_SAVES = 8
# The history keeps this many of each record (oldest dropped first).
MAX_SAVES = 256
MAX_INTERRUPTIONS = 1024
# Rounds of the fixed point in ``learn_cadence`` (it settles in two or three).
FIXED_POINT_ROUNDS = 8
HISTORY_MAX_BYTES = 1024 * 1024
INTERRUPTION_KINDS = ("notice", "restart", "restore")


# -- the formula --------------------------------------------------------------------------


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M) - C`` (never below 0)."""
    return max(0.0, math.sqrt(2.0 * save_seconds * mtbf_seconds) - save_seconds)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum work time between saves (module doc); 0 when C = 0,
    ``8M/9`` for C >= 2M."""
    c, m = max(0.0, save_seconds), max(0.0, mtbf_seconds)
    if c == 0.0 or m == 0.0:
        return 0.0
    x = min(1.0, c / (2.0 * m))
    # sqrt(2CM)(1 + sqrt(x)/3 + x/9) - C, written in x = C/2M with C clamped at 2M:
    # 2M (sqrt(x) + x/3 + x^1.5/9 - x).
    return 2.0 * m * (math.sqrt(x) - 2.0 * x / 3.0 + x * math.sqrt(x) / 9.0)


@dataclass(frozen=True)
class CadenceCost:
    """What a cadence costs, as fractions of wall time."""

    interval_seconds: float
    save_fraction: float  # time blocked by saves
    lost_work_fraction: float  # expected work thrown away by interruptions

    @property
    def total_fraction(self) -> float:
        return self.save_fraction + self.lost_work_fraction

    def to_json(self) -> dict[str, float]:
        return {
            "interval_seconds": round(self.interval_seconds, 3),
            "save_fraction": round(self.save_fraction, 6),
            "lost_work_fraction": round(self.lost_work_fraction, 6),
            "total_fraction": round(self.total_fraction, 6),
            "save_seconds_per_hour": round(3600.0 * self.save_fraction, 3),
            "lost_work_seconds_per_hour": round(3600.0 * self.lost_work_fraction, 3),
        }


def expected_cost(
    interval_seconds: float, save_seconds: float, mtbf_seconds: float, upload_seconds: float = 0.0
) -> CadenceCost:
    """The expected cost of saving every ``interval_seconds`` of work (module doc)."""
    t, c = max(0.0, interval_seconds), max(0.0, save_seconds)
    cycle = t + c
    save = c / cycle if cycle > 0 else 0.0
    lost = (cycle / 2.0 + max(0.0, upload_seconds)) / mtbf_seconds if mtbf_seconds > 0 else 1.0
    return CadenceCost(t, save, min(1.0, lost))


@dataclass(frozen=True)
class Bounds:
    """Limits on the advice: a floor and a ceiling on the interval."""

    min_interval: float = 60.0
    max_interval: float = 6 * 3600.0


def advised_interval(
    save_seconds: float,
    mtbf_seconds: float,
    upload_seconds: float = 0.0,
    bounds: Bounds = Bounds(),
) -> float:
    """The interval to advise: Daly's, no shorter than the upload (module doc) nor
    ``bounds.min_interval``, no longer than ``bounds.max_interval``."""
    t = max(daly_interval(save_seconds, mtbf_seconds), upload_seconds - save_seconds)
    return min(bounds.max_interval, max(bounds.min_interval, t))


# -- learning M ---------------------------------------------------------------------------


def distinct_interruptions(
    times: Iterable[float], merge_seconds: float = MERGE_SECONDS
) -> list[float]:
    """The times of the distinct interruptions among records at ``times``: one within
    ``merge_seconds`` of the last counted one is that same interruption."""
    counted: list[float] = []
    for at in sorted(times):
        if not counted or at - counted[-1] > merge_seconds:
            counted.append(at)
    return counted


def count_interruptions(times: Iterable[float], merge_seconds: float = MERGE_SECONDS) -> int:
    """How many distinct interruptions (``distinct_interruptions``)."""
    return len(distinct_interruptions(times, merge_seconds))


def costly_interruptions(distinct: Sequence[float], interval: float) -> int:
    """The interruptions that a save interval of ``interval`` could have lost work to
    (the first, and each that came more than ``interval`` after the one before).

    One that comes sooner after the previous one (the next blow of a burst: a zone out of
    capacity takes the replacement node too) loses the work since the restart whatever
    the interval, as no save could have happened yet: it says nothing about how often to
    save. Young's derivation charges half an interval per interruption, which holds for
    the others."""
    if not distinct:
        return 0
    return 1 + sum(1 for a, b in itertools.pairwise(distinct) if b - a > interval)


@dataclass(frozen=True)
class OtherRuns:
    """The interruption history of other runs on the same store (module doc, "Other
    runs"), reduced to what the estimate needs: their observed time and the gaps between
    their consecutive distinct interruptions, sorted, so that counting their costly
    interruptions at any interval is a bisection."""

    observed_seconds: float = 0.0
    runs_interrupted: int = 0  # runs with at least one interruption (its first is costly)
    gaps: tuple[float, ...] = ()  # sorted

    @classmethod
    def of(cls, histories: Iterable[History], merge_seconds: float = MERGE_SECONDS) -> OtherRuns:
        observed, interrupted, gaps = 0.0, 0, []
        for history in histories:
            observed += max(0.0, history.observed_seconds)
            distinct = distinct_interruptions((i.at for i in history.interruptions), merge_seconds)
            interrupted += bool(distinct)
            gaps += [b - a for a, b in itertools.pairwise(distinct)]
        return cls(observed, interrupted, tuple(sorted(gaps)))

    def costly(self, interval: float) -> int:
        """``costly_interruptions`` summed over the other runs, at ``interval``."""
        return self.runs_interrupted + len(self.gaps) - bisect.bisect_right(self.gaps, interval)


NO_OTHER_RUNS = OtherRuns()


def learn_cadence(
    distinct: Sequence[float],
    observed_seconds: float,
    save_seconds: float,
    upload_seconds: float,
    policy: CadencePolicy,
    others: OtherRuns = NO_OTHER_RUNS,
) -> tuple[float, float, int]:
    """``(interval, mtbf, interruptions counted)`` from a run's distinct interruptions
    (and ``others``'): the MTBF that matters for the interval is that of the costly ones
    (``costly_interruptions``), which depends on the interval; a few rounds of the fixed
    point settle it (the interval only grows from round to round, and is bounded). The
    count returned is the run's own."""
    if policy.mtbf_override is not None:
        mtbf = policy.mtbf_override
        return advised_interval(save_seconds, mtbf, upload_seconds, policy.bounds), mtbf, 0
    observed = observed_seconds + others.observed_seconds

    def mtbf_at(own: int, interval: float | None) -> float:
        other = (
            others.runs_interrupted + len(others.gaps)
            if interval is None
            else others.costly(interval)
        )
        return estimate_mtbf(observed, own + other, policy.prior_mtbf, policy.prior_weight)

    count = len(distinct)
    mtbf = mtbf_at(count, None)
    interval = advised_interval(save_seconds, mtbf, upload_seconds, policy.bounds)
    for _ in range(FIXED_POINT_ROUNDS):
        costly = costly_interruptions(distinct, interval)
        previous = mtbf
        count = costly
        mtbf = mtbf_at(count, interval)
        if mtbf == previous:
            break
        interval = advised_interval(save_seconds, mtbf, upload_seconds, policy.bounds)
    return interval, mtbf, count


def quick_repeats(distinct: Sequence[float], interval: float) -> list[float]:
    """The gaps between consecutive distinct interruptions no longer than ``interval``:
    the next blows of bursts, which ``costly_interruptions`` leaves out."""
    return [b - a for a, b in itertools.pairwise(distinct) if b - a <= interval]


def restart_interval(
    distinct: Sequence[float],
    interval: float,
    save_seconds: float,
    upload_seconds: float,
    bounds: Bounds = Bounds(),
) -> float:
    """The work time before the first save after a restart (module doc, "After a
    restart"): the mean gap of the run's quick repeats when an early save is worth its
    cost, else ``interval``; never longer than ``interval``."""
    repeats = quick_repeats(distinct, interval)
    if not repeats:
        return interval
    p = len(repeats) / len(distinct)
    gap = statistics.fmean(repeats)
    c, u = max(0.0, save_seconds), max(0.0, upload_seconds)
    if p * gap * math.exp(-1.0 - (c + u) / gap) <= c:
        return interval
    return min(interval, max(bounds.min_interval, gap))


def estimate_mtbf(
    observed_seconds: float,
    interruptions: int,
    prior_seconds: float = DEFAULT_PRIOR_MTBF_SECONDS,
    prior_weight: float = PRIOR_WEIGHT,
) -> float:
    """Posterior mean time between interruptions: ``(observed + w·prior) / (count + w)``."""
    return (max(0.0, observed_seconds) + prior_weight * prior_seconds) / (
        max(0, interruptions) + prior_weight
    )


# -- the history kept under the run --------------------------------------------------------


@dataclass(frozen=True)
class SaveRecord:
    """One committed checkpoint's costs."""

    checkpoint: str
    at: float  # wall clock: when it was complete locally
    save_seconds: float  # blocking save time (the trainer's report, else first file -> complete)
    upload_seconds: float  # complete -> committed
    basis: str = "files"  # "trainer" when the trainer reported its save time
    emergency: bool = False


@dataclass(frozen=True)
class Interruption:
    at: float
    kind: str  # notice | restart | restore
    source: str = ""  # aws, gcp, sigterm, exit code, ...
    node: str = ""


def restore_interruption(
    checkpoint: str, *, skipped: bool, resumes: bool, at: float, node: str
) -> Interruption | None:
    """The interruption a restore of ``checkpoint`` records, or None. A restore is how a
    fresh node resumes a run, so one that downloaded into the run's watch dir
    (``resumes``: the pod's restore step, ``ckptd exec``) counts as one of the run's
    interruptions. One that found the checkpoint already in place (``skipped``) is no
    sign the run stopped, nor is one into any other directory (a look at a checkpoint,
    a restore tried by hand): the run goes on where it was."""
    if skipped or not resumes:
        return None
    return Interruption(at, "restore", checkpoint, node)


@dataclass(frozen=True)
class History:
    """A run's cadence history, as stored in ``<run>/CADENCE``."""

    run_id: str
    observed_seconds: float = 0.0
    saves: tuple[SaveRecord, ...] = ()
    interruptions: tuple[Interruption, ...] = ()

    def to_bytes(self) -> bytes:
        doc = {
            "format": HISTORY_FORMAT,
            "run_id": self.run_id,
            "observed_seconds": round(self.observed_seconds, 3),
            "saves": [asdict(s) for s in self.saves],
            "interruptions": [asdict(i) for i in self.interruptions],
        }
        return json.dumps(doc, sort_keys=True).encode()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def parse_history(body: bytes, run_id: str) -> History:
    """The stored history, or an empty one when it is absent, not ours or unreadable
    (garbage costs the learned figures, never the daemon); bad records are skipped."""
    empty = History(run_id)
    if len(body) > HISTORY_MAX_BYTES:
        return empty
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return empty
    if not isinstance(doc, dict) or doc.get("format") != HISTORY_FORMAT:
        return empty
    saves: list[SaveRecord] = []
    for raw in doc.get("saves") or []:
        if not isinstance(raw, dict):
            continue
        at, save, upload = (_number(raw.get(k)) for k in ("at", "save_seconds", "upload_seconds"))
        name = raw.get("checkpoint")
        if at is None or save is None or upload is None or not isinstance(name, str):
            continue
        basis = raw.get("basis") if raw.get("basis") in ("trainer", "files") else "files"
        saves.append(SaveRecord(name, at, save, upload, str(basis), raw.get("emergency") is True))
    interruptions: list[Interruption] = []
    for raw in doc.get("interruptions") or []:
        if not isinstance(raw, dict):
            continue
        at = _number(raw.get("at"))
        kind = raw.get("kind")
        if at is None or kind not in INTERRUPTION_KINDS:
            continue
        interruptions.append(
            Interruption(
                at, str(kind), str(raw.get("source", ""))[:64], str(raw.get("node", ""))[:128]
            )
        )
    observed = _number(doc.get("observed_seconds")) or 0.0
    return History(
        run_id, observed, tuple(saves[-MAX_SAVES:]), tuple(interruptions[-MAX_INTERRUPTIONS:])
    )


def merge_history(
    stored: History,
    *,
    saves: Sequence[SaveRecord] = (),
    interruptions: Sequence[Interruption] = (),
    observed_seconds: float = 0.0,
) -> History:
    """``stored`` plus this daemon's new records (a record already there is not added
    twice) and its observed time; the read-modify-write of ``<run>/CADENCE``."""
    have_saves = {(s.checkpoint, s.at) for s in stored.saves}
    new_saves = [s for s in saves if (s.checkpoint, s.at) not in have_saves]
    have = set(stored.interruptions)
    new_interruptions = [i for i in interruptions if i not in have]
    all_saves = sorted([*stored.saves, *new_saves], key=lambda s: s.at)[-MAX_SAVES:]
    all_interruptions = sorted([*stored.interruptions, *new_interruptions], key=lambda i: i.at)
    return replace(
        stored,
        observed_seconds=stored.observed_seconds + max(0.0, observed_seconds),
        saves=tuple(all_saves),
        interruptions=tuple(all_interruptions[-MAX_INTERRUPTIONS:]),
    )


# -- the advice -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CadencePolicy:
    """What the config says (``[cadence]``)."""

    mtbf_override: float | None = None  # seconds; None = learn
    prior_mtbf: float = DEFAULT_PRIOR_MTBF_SECONDS
    bounds: Bounds = field(default_factory=Bounds)
    merge_seconds: float = MERGE_SECONDS
    prior_weight: float = PRIOR_WEIGHT


@dataclass(frozen=True)
class Advice:
    run_id: str
    interval_seconds: float
    restart_interval_seconds: float  # before the first save after a restart
    save_seconds: float
    upload_seconds: float
    mtbf_seconds: float
    basis: dict[str, str]
    interruptions: int
    costly_interruptions: int
    quick_repeats: int
    observed_seconds: float
    saves_measured: int
    advised: CadenceCost
    current: CadenceCost | None

    def to_json(self) -> dict[str, Any]:
        return {
            "interval_seconds": round(self.interval_seconds, 3),
            "restart_interval_seconds": round(self.restart_interval_seconds, 3),
            "save_seconds": round(self.save_seconds, 3),
            "upload_seconds": round(self.upload_seconds, 3),
            "mtbf_seconds": round(self.mtbf_seconds, 3),
            "basis": self.basis,
            "interruptions": self.interruptions,
            "costly_interruptions": self.costly_interruptions,
            "quick_repeats": self.quick_repeats,
            "observed_seconds": round(self.observed_seconds, 3),
            "saves_measured": self.saves_measured,
            "expected_cost": {
                "advised": self.advised.to_json(),
                "current": None if self.current is None else self.current.to_json(),
            },
        }


def recent_costs(saves: Sequence[SaveRecord]) -> tuple[float, float, str, int]:
    """``(save seconds, upload seconds, basis, saves used)`` from the recent routine saves:
    medians, the trainer's own reports preferred over file times when there are any."""
    routine = [s for s in saves if not s.emergency] or list(saves)
    reported = [s for s in routine if s.basis == "trainer"]
    chosen = (reported or routine)[-RECENT_SAVES:]
    if not chosen:
        return 0.0, 0.0, "none", 0
    save = statistics.median(s.save_seconds for s in chosen)
    upload = statistics.median(s.upload_seconds for s in chosen)
    return save, upload, "trainer" if reported else "files", len(chosen)


def current_interval(saves: Sequence[SaveRecord], save_seconds: float) -> float | None:
    """The work time between the run's recent routine saves (median gap between them,
    less the save), or None with fewer than two."""
    times = sorted(s.at for s in saves if not s.emergency)[-(RECENT_SAVES + 1) :]
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    if not gaps:
        return None
    return max(0.0, statistics.median(gaps) - save_seconds)


# The interval's share while the loss is volatile: the rollback target that much nearer.
VOLATILE_FACTOR = 0.5


def while_volatile(advice: Advice, bounds: Bounds) -> Advice:
    """``advice`` while the run's loss is volatile: both intervals times ``VOLATILE_FACTOR``,
    never below the bounds' floor or the upload's (``advised_interval``); basis "loss"."""
    floor = max(bounds.min_interval, advice.upload_seconds - advice.save_seconds)
    t, r = (
        min(x, max(floor, x * VOLATILE_FACTOR))
        for x in (advice.interval_seconds, advice.restart_interval_seconds)
    )
    cost = expected_cost(t, advice.save_seconds, advice.mtbf_seconds, advice.upload_seconds)
    basis = {**advice.basis, "loss": "volatile"}
    return replace(
        advice, interval_seconds=t, restart_interval_seconds=r, basis=basis, advised=cost
    )


def advise(history: History, policy: CadencePolicy, others: OtherRuns = NO_OTHER_RUNS) -> Advice:
    """The advised cadence for a run with ``history``, and ``others``' on the same store."""
    save, upload, save_basis, used = recent_costs(history.saves)
    distinct = distinct_interruptions((i.at for i in history.interruptions), policy.merge_seconds)
    interval, mtbf, costly = learn_cadence(
        distinct, history.observed_seconds, save, upload, policy, others
    )
    if policy.mtbf_override is not None:
        mtbf_basis = "config"
    elif distinct:
        mtbf_basis = "measured"
    else:
        mtbf_basis = "other runs" if others.observed_seconds > 0 else "prior"
    count = len(distinct)
    now_interval = current_interval(history.saves, save)
    return Advice(
        run_id=history.run_id,
        interval_seconds=interval,
        restart_interval_seconds=restart_interval(distinct, interval, save, upload, policy.bounds),
        save_seconds=save,
        upload_seconds=upload,
        mtbf_seconds=mtbf,
        basis={"save": save_basis, "mtbf": mtbf_basis},
        interruptions=count,
        costly_interruptions=costly,
        quick_repeats=len(quick_repeats(distinct, interval)),
        observed_seconds=history.observed_seconds,
        saves_measured=used,
        advised=expected_cost(interval, save, mtbf, upload),
        current=None if now_interval is None else expected_cost(now_interval, save, mtbf, upload),
    )


__all__ = [
    "HISTORY_FORMAT",
    "MERGE_SECONDS",
    "NO_OTHER_RUNS",
    "PRIOR_WEIGHT",
    "VOLATILE_FACTOR",
    "Advice",
    "Bounds",
    "CadenceCost",
    "CadencePolicy",
    "History",
    "Interruption",
    "OtherRuns",
    "SaveRecord",
    "advise",
    "advised_interval",
    "costly_interruptions",
    "count_interruptions",
    "current_interval",
    "daly_interval",
    "distinct_interruptions",
    "estimate_mtbf",
    "expected_cost",
    "learn_cadence",
    "merge_history",
    "parse_history",
    "quick_repeats",
    "recent_costs",
    "restart_interval",
    "restore_interruption",
    "while_volatile",
    "young_interval",
]
