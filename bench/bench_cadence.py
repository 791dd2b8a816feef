"""Fixed save intervals against ckptd's advised cadence, over preemption traces.

    .venv/bin/python bench/bench_cadence.py [--days 90] [--save-seconds 30]
        [--upload-seconds 60] [--seeds 3] [--json FILE]

A pure simulation (no daemon, no clock): training alternates work and a blocking save of
``--save-seconds``; a checkpoint is durable ``--upload-seconds`` after its save ends; an
interruption throws away the work since the newest durable checkpoint, and training
resumes from it. Waste per day = time in saves + work thrown away.

Traces span one interruption an hour to one a week, Poisson and bursty (bursts of
interruptions minutes apart, e.g. a zone running out of capacity, then quiet). The
"advised" policy is ``ckptd.cadence.advise`` learning the rate online, as the daemon
does: after each save it sees only the interruptions so far and the time observed, and
starts from the same prior on every trace. The "best fixed in hindsight" is the best of a
fine grid of fixed intervals, chosen per trace after the fact (a choice no one can make
in advance). Exit 1 if the advised cadence is more than ``--tolerance`` worse than that on
any trace.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptd.cadence import (
    CadencePolicy,
    History,
    Interruption,
    advise,
)

DAY = 86400.0
HOUR = 3600.0
# The fixed intervals people pick, shown as columns (minutes of training between saves).
FIXED_MINUTES = (5, 15, 30, 60, 120, 240)
# The grid "best in hindsight" is taken over: 2 min .. 12 h, 4% apart.
GRID = [120.0 * 1.04**k for k in range(int(math.log(360) / math.log(1.04)) + 1)]


@dataclass(frozen=True)
class Trace:
    name: str
    mtbf_hours: float
    times: list[float]  # interruption times, seconds from the start


def poisson_trace(mtbf: float, horizon: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf)
        if t >= horizon:
            return times
        times.append(t)


def bursty_trace(mtbf: float, horizon: float, rng: random.Random) -> list[float]:
    """Bursts of a geometric number of interruptions (mean 4), 20 minutes apart on
    average; bursts arrive Poisson so that the mean rate is 1/mtbf."""
    per_burst = 4.0
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / (mtbf * per_burst))
        if t >= horizon:
            return sorted(times)
        s = t
        while True:
            times.append(s)
            if rng.random() < 1.0 / per_burst:
                break
            s += rng.expovariate(1.0 / 1200.0)
            if s >= horizon:
                break


Policy = Callable[[float, int], float]  # (now, interruptions so far) -> interval


def simulate(times: list[float], horizon: float, c: float, u: float, policy: Policy) -> float:
    """Seconds wasted (saving + lost work) over ``horizon``."""
    wasted = 0.0
    start = 0.0
    for seen, end in enumerate([*times, horizon]):
        # One segment: from a (re)start at ``start`` to an interruption (or the end) at ``end``.
        t = start
        durable_at: list[tuple[float, float]] = []  # (when durable, work retained so far)
        work = 0.0
        saving = 0.0
        while True:
            interval = policy(t, seen)
            if t + interval >= end:
                work += end - t
                break
            work += interval
            t += interval
            if t + c >= end:
                saving += end - t
                break
            t += c
            saving += c
            durable_at.append((t + u, work))
        if end == horizon and seen == len(times):
            wasted += saving  # the run ends: all its work is kept
        else:
            kept = max((w for at, w in durable_at if at <= end), default=0.0)
            wasted += saving + (work - kept)
        start = end
    return wasted


def fixed(interval: float) -> Policy:
    return lambda now, seen: interval


def advised(times: list[float], c: float, u: float) -> Policy:
    policy = CadencePolicy()
    cache: dict[tuple[int, int], float] = {}

    def choose(now: float, seen: int) -> float:
        # The daemon's history: every interruption so far, the time observed, the costs.
        key = (seen, int(now // 600))  # the advice moves slowly: recompute each 10 minutes
        if key not in cache:
            history = History(
                "sim",
                observed_seconds=now,
                interruptions=tuple(Interruption(at, "notice") for at in times[:seen]),
            )
            a = advise(history, policy)
            # The measured save costs enter through the saves; here they are known constants.
            from ckptd.cadence import advised_interval

            cache[key] = advised_interval(c, a.mtbf_seconds, u, policy.bounds)
        return cache[key]

    return choose


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--days", type=float, default=90.0)
    p.add_argument("--save-seconds", type=float, default=30.0)
    p.add_argument("--upload-seconds", type=float, default=60.0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    horizon, c, u = args.days * DAY, args.save_seconds, args.upload_seconds
    traces: list[Trace] = []
    for seed in range(args.seeds):
        for kind, make in (("poisson", poisson_trace), ("bursty", bursty_trace)):
            for hours in (1, 4, 24, 168):
                rng = random.Random(f"{kind}-{hours}-{seed}")
                traces.append(
                    Trace(f"{kind} 1/{hours}h #{seed}", hours, make(hours * HOUR, horizon, rng))
                )
    rows = []
    worst_fixed_everywhere = {m: 0.0 for m in FIXED_MINUTES}
    ok = True
    for trace in traces:
        per_day = args.days

        def cost(policy: Policy, trace: Trace = trace) -> float:
            return simulate(trace.times, horizon, c, u, policy) / per_day

        grid = [(cost(fixed(t)), t) for t in GRID]
        best, best_t = min(grid)
        adv = cost(advised(trace.times, c, u))
        fixed_costs = {m: cost(fixed(m * 60.0)) for m in FIXED_MINUTES}
        for m, v in fixed_costs.items():
            worst_fixed_everywhere[m] = max(worst_fixed_everywhere[m], v / best - 1)
        excess = adv / best - 1
        ok = ok and excess <= args.tolerance
        rows.append(
            {
                "trace": trace.name,
                "interruptions": len(trace.times),
                "advised_min_per_day": adv / 60,
                "advised_excess": excess,
                "best_fixed_min": best_t / 60,
                "best_min_per_day": best / 60,
                "fixed_min_per_day": {m: v / 60 for m, v in fixed_costs.items()},
            }
        )
    head = "| trace | n | advised (min/day) | vs best | best fixed | " + " | ".join(
        f"every {m} min" for m in FIXED_MINUTES
    )
    print(
        f"# {args.days:g} days, save {c:g} s, upload {u:g} s; {platform.machine()} "
        f"{platform.python_version()}, {datetime.now(UTC):%Y-%m-%d}"
    )
    print(head + " |")
    print("|" + " --- |" * (5 + len(FIXED_MINUTES)))
    for r in rows:
        fixed_cells = " | ".join(f"{r['fixed_min_per_day'][m]:.0f}" for m in FIXED_MINUTES)
        print(
            f"| {r['trace']} | {r['interruptions']} | {r['advised_min_per_day']:.1f} | "
            f"{100 * r['advised_excess']:+.1f}% | {r['best_fixed_min']:.0f} min: "
            f"{r['best_min_per_day']:.1f} | {fixed_cells} |"
        )
    worst_adv = max(r["advised_excess"] for r in rows)
    print(f"\nadvised: at most {100 * worst_adv:+.1f}% over the best fixed interval in hindsight")
    for m, v in worst_fixed_everywhere.items():
        print(f"every {m} min: up to {100 * v:+.0f}% over the best fixed interval in hindsight")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "worst_advised": worst_adv}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
