"""The fleet campaign (#48): a many-node DDP job on spot nodes, reclaimed again and again
from a seeded trace, under each policy; goodput, steps lost, resume time and final weights.

```sh
.venv/bin/python bench/bench_fleet.py --smoke --out /tmp/fleet             # 2 nodes, ~1.5 min
.venv/bin/python bench/bench_fleet.py --nodes 4 --seed 1 --scale 0.1 \
    --policies uninterrupted,ckptd,ckptd-no-peers,sync-loop --out /tmp/fleet
```

Root and the kernel's network namespaces (``tests/support/netns.py``): ``--nodes`` hosts on
``--node-mbit`` links and a SeaweedFS behind a link ``--store-ratio`` of theirs
(``bench/_fleet_cluster.py``); one DDP rank per node over gloo
(``tests/support/trainers/fleet_ddp.py``); the trace (``bench/_fleet_trace.py``) played on
the wall clock (``bench/_fleet_scheduler.py``) against each policy in turn
(``bench/_fleet_policies.py``), the same trace for each. Every rank logs to
``OUT/<policy>/node<k>-a<attempt>.jsonl``, the scheduler to ``OUT/<policy>/events.jsonl``;
the figures and the HTML timeline are computed from those files alone
(``bench/_fleet_figures.py``, ``bench/_fleet_report.py``), so a run can be re-reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._fleet_cluster import Cluster, JobSpec  # noqa: E402
from bench._fleet_commits import CommitWatcher  # noqa: E402
from bench._fleet_policies import Policy, parse  # noqa: E402
from bench._fleet_report import write as write_report  # noqa: E402
from bench._fleet_scheduler import Outcome, Scheduler  # noqa: E402
from bench._fleet_trace import Trace, make_trace, smoke_trace  # noqa: E402
from tests.support.netns import Shape  # noqa: E402
from tests.support.peer_cluster import peer_rig  # noqa: E402

SMOKE_GAP = 5.0  # scaled s of training before each smoke event


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--scale", type=float, default=0.1, help="trace seconds per real second")
    p.add_argument("--duration", type=float, default=240.0, help="the trace's length (scaled s)")
    p.add_argument("--policies", default="uninterrupted,ckptd,ckptd-no-peers,sync-loop")
    p.add_argument("--smoke", action="store_true", help="2 nodes, the smoke trace, 2 policies")
    p.add_argument("--out", type=Path, default=None, help="logs, tables, timeline")
    p.add_argument("--steps", type=int, default=0, help="0: enough to outlast the trace")
    p.add_argument("--step-sleep", type=float, default=0.15, help="a step's compute stand-in")
    p.add_argument("--save-every", type=int, default=20, help="periodic saves, in steps")
    p.add_argument("--ballast-mib", type=int, default=2, help="extra MiB per rank per save")
    p.add_argument("--node-mbit", type=float, default=400.0)
    p.add_argument("--store-ratio", type=float, default=0.25)
    p.add_argument("--grace", type=float, default=8.0, help="survivors' time to end alone")
    p.add_argument(
        "--keep-disks",
        action="store_true",
        help="a relaunch keeps survivors' checkpoint dirs (hostPath), not emptied (emptyDir)",
    )
    p.add_argument("--deadline", type=float, default=0, help="per policy, s (0: from steps)")
    o = p.parse_args(argv)
    if o.smoke:
        o.nodes = 2
        if o.step_sleep == p.get_default("step_sleep"):
            o.step_sleep = 0.1
        if o.policies == p.get_default("policies"):
            o.policies = "uninterrupted,ckptd"
    return o


def the_trace(o: argparse.Namespace) -> Trace:
    if o.smoke:
        return smoke_trace(o.seed, min_gap=SMOKE_GAP)
    return make_trace(o.seed, o.nodes, scale=o.scale, duration=o.duration)


def steps_for(o: argparse.Namespace, trace: Trace) -> int:
    """Enough steps that the job still trains at the trace's last event (the time it is
    down only adds to that)."""
    if o.steps:
        return int(o.steps)
    last = max((ev.at for ev in trace.events), default=10.0)
    return int((last + 4.0) / max(o.step_sleep, 0.05)) + 10


def run_policy(
    prig: Any, policy: Policy, o: argparse.Namespace, trace: Any, job: JobSpec
) -> Outcome:
    out = o.out / policy.name
    shutil.rmtree(out, ignore_errors=True)
    prig.reset(f"{policy.name}-{o.seed}-{int(time.time())}")
    spec = job if policy.saves else JobSpec(**{**job.__dict__, "save_every": 0})
    cluster = Cluster(prig, out, spec, policy.mode, policy.peers, Shape(o.node_mbit))
    resume_for = None
    loops = None
    if policy.sync:
        from bench._fleet_sync import SyncLoops

        loops = SyncLoops(prig)
        resume_for = loops.blind_restore
    events = trace.events if policy.events else ()
    deadline = o.deadline or max(120.0, job.steps * job.step_sleep * 6 + 60)
    scheduler = Scheduler(
        cluster, events, deadline=deadline, grace=o.grace, resume_for=resume_for,
        on_launch=loops.follow if loops else None,
    )  # fmt: skip
    print(f"{policy.name}: {job.nodes} nodes, {job.steps} steps, {len(events)} events")
    watcher = CommitWatcher(
        prig.client(), prig.prefix, out, copied_by=job.nodes if policy.sync else 0
    ).start()
    try:
        outcome = scheduler.run()
    finally:
        watcher.close()
        if loops is not None:
            loops.close()
        tail = cluster.proc_logs()
        cluster.close()
    if not outcome.finished:
        print(f"{policy.name}: NOT finished ({outcome.note}); last logs:\n{tail}")
    print(f"{policy.name}: {outcome.wall_seconds:.1f} s, {outcome.launches} launches")
    return outcome


def stop_on_sigterm() -> None:
    """SIGTERM (a timeout, CI) unwinds like Ctrl-C: every namespace is deleted."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    o = options(argv)
    stop_on_sigterm()
    policies = parse(o.policies)
    trace = the_trace(o)
    o.out = (o.out or Path(tempfile.mkdtemp(prefix="fleet-"))).resolve()
    o.out.mkdir(parents=True, exist_ok=True)
    job = JobSpec(
        nodes=o.nodes,
        steps=steps_for(o, trace),
        save_every=o.save_every,
        step_sleep=o.step_sleep,
        ballast_mib=o.ballast_mib,
        seed=o.seed,
    )
    (o.out / "trace.json").write_text(trace.to_json())
    (o.out / "campaign.json").write_text(
        json.dumps(
            {
                "nodes": o.nodes, "seed": o.seed, "scale": o.scale, "smoke": o.smoke,
                "job": job.__dict__, "node_mbit": o.node_mbit,
                "store_mbit": o.node_mbit * o.store_ratio,
                "events": [ev.__dict__ for ev in trace.events],
            },
            indent=1,
            default=list,
        )
    )  # fmt: skip
    began = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    work = Path(tempfile.mkdtemp(prefix="fleet-work-"))
    try:
        with peer_rig(work, store=Shape(o.node_mbit * o.store_ratio), prefix="fleet") as prig:
            for policy in policies:
                outcomes[policy.name] = run_policy(prig, policy, o, trace, job)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_report(o.out, [p.name for p in policies])
    print(f"campaign: {time.monotonic() - began:.1f} s wall; logs in {o.out}")
    return 0 if all(oc.finished for oc in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
