"""Fixed save intervals against ckptd's advised cadence, over preemption traces.

    .venv/bin/python bench/bench_cadence.py [--runs 10] [--min-interruptions 6000]
        [--days 60] [--save-seconds 30] [--upload-seconds 60] [--seed 0]
        [--tolerance 0.10] [--own-history-only] [--json FILE]

A pure simulation (no daemon, no clock; about 70 s on one core). Training alternates work
and a blocking save of ``--save-seconds``; a checkpoint is durable ``--upload-seconds``
after its save ends; an interruption throws away the work since the newest durable
checkpoint, and training resumes from it. Waste = time in saves + work thrown away, in
minutes per day.

A trace is ``--runs`` runs of ``--days`` days, their interruptions Poisson or bursty
(bursts of a geometric number of interruptions, mean 4, twenty minutes apart on average:
a zone running out of capacity; then quiet), from one an hour to one a week on average.

- "advised": ``ckptd.cadence.model`` as the daemon runs it. Each run starts with no history
  of its own (the default prior, the same for every trace) and learns its rate as it
  goes: the interval is recomputed every ten minutes of the run from the interruptions so
  far (merged as the daemon merges them) and the time observed. The runs of a trace are
  one fleet's, one after another on the same store: each also counts the histories of
  the runs before it (``learn_from_other_runs``, the default; the first run has none).
  "own history only" is the same with ``learn_from_other_runs = false``
  (``--own-history-only`` makes it the main column). After each interruption the
  first save comes after the advice's restart interval, as ``AdvisedCadence`` saves (the
  first save of a process), then every advised interval.
- "every N min": a fixed interval, as ``save_steps`` gives.
- "best fixed in hindsight": the best of a fine grid of fixed intervals (2 min to 12 h,
  4% apart) for that trace, chosen after seeing it: a choice no one can make in advance.
  It is the luckiest of about 150 noisy figures, so each trace holds at least
  ``--min-interruptions`` interruptions: with 600, where each phase of an interval falls
  moves a figure by about 1%, and the best of the grid beat the best interval for the
  trace's process by 2-3% on luck alone.

Exit 1 if the advised cadence is more than ``--tolerance`` (10%) worse than the best fixed
interval in hindsight on any trace.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptd.cadence.model import (
    DEFAULT_PRIOR_MTBF_SECONDS,
    MERGE_SECONDS,
    NO_OTHER_RUNS,
    PRIOR_WEIGHT,
    CadencePolicy,
    History,
    Interruption,
    OtherRuns,
    distinct_interruptions,
    learn_cadence,
    restart_interval,
)

DAY = 86400.0
HOUR = 3600.0
FIXED_MINUTES = (5, 15, 30, 60, 120, 240)
GRID = [120.0 * 1.04**k for k in range(int(math.log(360) / math.log(1.04)) + 1)]
RATES_HOURS = (1, 4, 24, 168)
# The advised interval is recomputed this often (the daemon refreshes it each second, the
# trainer re-reads it each few seconds; ten minutes keeps the simulation fast).
ADVICE_REFRESH_SECONDS = 600.0


@dataclass(frozen=True)
class Run:
    times: list[float]  # interruption times, seconds from the run's start
    horizon: float


def poisson_times(mtbf: float, horizon: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    while (t := t + rng.expovariate(1.0 / mtbf)) < horizon:
        times.append(t)
    return times


def bursty_times(mtbf: float, horizon: float, rng: random.Random) -> list[float]:
    per_burst, spacing = 4.0, 1200.0
    times: list[float] = []
    t = 0.0
    while (t := t + rng.expovariate(1.0 / (mtbf * per_burst))) < horizon:
        s = t
        while s < horizon:
            times.append(s)
            if rng.random() < 1.0 / per_burst:
                break
            s += rng.expovariate(1.0 / spacing)
    return sorted(times)


@dataclass(frozen=True)
class Segments:
    """A trace's runs as one array of the spans between restarts (numpy-fast)."""

    lengths: np.ndarray  # seconds from a (re)start to the next interruption or the end
    final: np.ndarray  # True for each run's last span: the run ends, its work is kept

    @classmethod
    def of(cls, runs: list[Run]) -> Segments:
        lengths = [np.diff(np.array([0.0, *r.times, r.horizon])) for r in runs]
        final = [np.arange(len(x)) == len(x) - 1 for x in lengths]
        return cls(np.concatenate(lengths), np.concatenate(final))


def fixed_waste(segments: Segments, t: float, c: float, u: float) -> float:
    """Seconds wasted by saving after every ``t`` seconds of work (closed form)."""
    lengths = segments.lengths
    cycle = t + c
    full = np.floor(lengths / cycle)
    rem = lengths - full * cycle
    saving = full * c + np.clip(rem - t, 0.0, c)
    work = lengths - saving
    durable = np.clip(np.floor((lengths - u) / cycle), 0.0, full)
    lost = work - durable * t
    lost[segments.final] = 0.0  # the run ends: all its work is kept
    return float(saving.sum() + lost.sum())


def advised_waste(
    run: Run,
    c: float,
    u: float,
    policy: CadencePolicy,
    after_restart: bool = True,
    others: OtherRuns = NO_OTHER_RUNS,
) -> float:
    """Seconds wasted following the advice, learned online from the run's own history
    and ``others`` (``after_restart=False``: the interval only, the restart interval
    ignored)."""
    wasted = 0.0
    start = 0.0
    distinct: list[float] = []
    cache: dict[tuple[int, int], tuple[float, float]] = {}

    def interval(now: float, first: bool) -> float:
        key = (len(distinct), int(now // ADVICE_REFRESH_SECONDS))
        if key not in cache:
            every = learn_cadence(distinct, now, c, u, policy, others)[0]
            restart = restart_interval(distinct, every, c, u, policy.bounds)
            cache[key] = (every, restart if after_restart else every)
        return cache[key][1 if first else 0]

    for index, end in enumerate([*run.times, run.horizon]):
        t, work, saving, kept = start, 0.0, 0.0, 0.0
        durable: list[tuple[float, float]] = []
        while True:
            # The trainer (re)starts at ``start``: its first save follows the restart
            # interval, the later ones the interval.
            step = interval(t, first=not durable)
            if t + step >= end:
                work += end - t
                break
            work, t = work + step, t + step
            if t + c >= end:
                saving += end - t
                break
            t, saving = t + c, saving + c
            durable.append((t + u, work))
        if index < len(run.times):
            kept = max((w for at, w in durable if at <= end), default=0.0)
            wasted += saving + work - kept
            # The daemon records the interruption; one within MERGE_SECONDS of the last
            # counted one is the same (ckptd.cadence.model.count_interruptions).
            if not distinct or end - distinct[-1] > policy.merge_seconds:
                distinct.append(end)
        else:
            wasted += saving
        start = end
    assert distinct == distinct_interruptions(run.times, policy.merge_seconds)
    return wasted


def fleet_waste(
    runs: list[Run], c: float, u: float, policy: CadencePolicy, after_restart: bool, pooled: bool
) -> float:
    """``advised_waste`` summed over a trace's runs, each counting the runs before it
    (``pooled``) or its own history only."""
    total, before = 0.0, []
    for run in runs:
        others = OtherRuns.of(before, policy.merge_seconds) if pooled else NO_OTHER_RUNS
        total += advised_waste(run, c, u, policy, after_restart, others)
        interruptions = tuple(Interruption(at, "notice") for at in run.times)
        before.append(History("earlier", run.horizon, interruptions=interruptions))
    return total


def make_runs(kind: str, hours: float, runs: int, days: float, seed: int) -> list[Run]:
    make: Callable[[float, float, random.Random], list[float]] = (
        poisson_times if kind == "poisson" else bursty_times
    )
    rng = random.Random(f"{kind}-{hours}-{seed}")
    return [Run(make(hours * HOUR, days * DAY, rng), days * DAY) for _ in range(runs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--min-interruptions", type=int, default=6000)
    p.add_argument("--days", type=float, default=60.0)
    p.add_argument("--save-seconds", type=float, default=30.0)
    p.add_argument("--upload-seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--prior-weight", type=float, default=PRIOR_WEIGHT)
    p.add_argument("--prior-hours", type=float, default=DEFAULT_PRIOR_MTBF_SECONDS / HOUR)
    p.add_argument(
        "--no-restart-interval",
        action="store_true",
        help="follow the advised interval only, also after a restart (for comparison)",
    )
    p.add_argument(
        "--own-history-only",
        action="store_true",
        help="the main column without the earlier runs' histories (learn_from_other_runs off)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    c, u = args.save_seconds, args.upload_seconds
    policy = CadencePolicy(
        prior_mtbf=args.prior_hours * HOUR,
        merge_seconds=MERGE_SECONDS,
        prior_weight=args.prior_weight,
    )
    rows = []
    for kind in ("poisson", "bursty"):
        for hours in RATES_HOURS:
            # Enough runs that each trace holds about --min-interruptions: fewer, and the
            # best fixed interval in hindsight is mostly the luck of where they fell.
            n_runs = max(args.runs, math.ceil(args.min_interruptions * hours / (args.days * 24)))
            runs = make_runs(kind, hours, n_runs, args.days, args.seed)
            segments = Segments.of(runs)
            total_days = n_runs * args.days

            def per_day(waste: float, total_days: float = total_days) -> float:
                return waste / total_days / 60.0  # minutes per day

            grid = [(per_day(fixed_waste(segments, t, c, u)), t) for t in GRID]
            best, best_t = min(grid)
            restart = not args.no_restart_interval
            pooled = per_day(fleet_waste(runs, c, u, policy, restart, pooled=True))
            own = per_day(fleet_waste(runs, c, u, policy, restart, pooled=False))
            advised, other = (own, pooled) if args.own_history_only else (pooled, own)
            fixed = {m: per_day(fixed_waste(segments, m * 60.0, c, u)) for m in FIXED_MINUTES}
            rows.append(
                {
                    "trace": f"{kind}, 1 per {hours} h",
                    "runs": n_runs,
                    "interruptions_per_day": sum(len(r.times) for r in runs) / total_days,
                    "advised": advised,
                    "advised_excess": advised / best - 1,
                    "other_advised": other,
                    "other_excess": other / best - 1,
                    "best_fixed_minutes": best_t / 60.0,
                    "best": best,
                    "fixed": fixed,
                }
            )
    print(
        f"# runs of {args.days:g} days, at least {args.runs} and {args.min_interruptions} "
        f"interruptions per trace; save {c:g} s, upload {u:g} s; "
        f"seed {args.seed}; {platform.machine()}, Python {platform.python_version()}, "
        f"{datetime.now(UTC):%Y-%m-%d}"
    )
    print("waste = saving + lost work, minutes per day\n")
    fixed_head = " | ".join(f"every {m} min" for m in FIXED_MINUTES)
    other_head = "with earlier runs" if args.own_history_only else "own history only"
    print(
        f"| trace | advised | vs best fixed | {other_head} | best fixed (hindsight) | "
        f"{fixed_head} |"
    )
    print("|" + " --- |" * (5 + len(FIXED_MINUTES)))
    for r in rows:
        cells = " | ".join(
            f"{v:.1f} ({100 * (v / r['best'] - 1):+.0f}%)" for v in r["fixed"].values()
        )
        print(
            f"| {r['trace']} | {r['advised']:.1f} | {100 * r['advised_excess']:+.1f}% | "
            f"{r['other_advised']:.1f} ({100 * r['other_excess']:+.1f}%) | "
            f"{r['best']:.1f} (every {r['best_fixed_minutes']:.0f} min) | {cells} |"
        )
    worst = max(r["advised_excess"] for r in rows)
    print(f"\nadvised: at most {100 * worst:+.1f}% over the best fixed interval in hindsight")
    other_worst = max(r["other_excess"] for r in rows)
    print(f"advised, {other_head}: at most {100 * other_worst:+.1f}% over it")
    for m in FIXED_MINUTES:
        excess = max(r["fixed"][m] / r["best"] - 1 for r in rows)
        print(f"every {m} min: up to {100 * excess:+.0f}% over it")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "worst_advised_excess": worst}, indent=2))
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
