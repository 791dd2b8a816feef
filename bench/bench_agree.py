"""What the ranks' per-step agreement costs a training step, on CPU (gloo).

    .venv/bin/python bench/bench_agree.py [--ranks 2,4] [--steps 600] [--json FILE]

Per rank count R: R processes of one torch.distributed job (gloo on 127.0.0.1, launched as
torchrun would). Each runs a stand-in data-parallel training step (a 2-layer MLP's
forward and backward on one thread, its gradients all-reduced as DDP does, an SGD step:
about a millisecond) in blocks of ``--block`` steps, the modes interleaved so that drift
on a shared machine hits them alike:

- ``none``: the step alone, as without ckptd (no callback, no listener);
- ``ckptd``: the step, then what the HF and Lightning callbacks do per step:
  ``agree_any(preempted(), cadence_due)``, one all-reduce of a CPU int32 tensor;
- ``agree only``: the agreement alone, no step (the collective's own latency).

Prints one table: ranks, steps per mode, median per-step µs with and without, the
difference, the ratio, and the agreement alone; ``--json`` writes the same. Every rank's
steps after the first block are pooled. The step's own gradient all-reduce already makes
each rank wait for the slowest, so the difference is the agreement's own price; with more
ranks than cores the processes also wait for a core, and the figures say so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "ckptd", "agree only")


def worker(out: Path, steps: int, block: int) -> None:
    """One rank: the modes in interleaved blocks; per-step ns written to ``out``."""
    import torch
    import torch.distributed as dist

    import ckptd.trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    ckptd.trainer.install(out.parent)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(32, 128)

    params = list(model.parameters())

    def train_step() -> None:
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        # The gradients averaged over the ranks, as DDP does: every multi-rank step meets
        # the other ranks once already, with or without ckptd.
        grads = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        dist.all_reduce(grads)
        optimizer.step()

    def ckptd_step() -> None:
        train_step()
        ckptd.trainer.agree_any(ckptd.trainer.preempted(), False)

    def agree_only() -> None:
        ckptd.trainer.agree_any(ckptd.trainer.preempted(), False)

    actions = {"none": train_step, "ckptd": ckptd_step, "agree only": agree_only}
    times: dict[str, list[int]] = {mode: [] for mode in MODES}
    dist.barrier()
    for first in range(0, steps, block):
        for mode in MODES:
            action = actions[mode]
            dist.barrier()  # every rank starts the block together
            for _ in range(min(block, steps - first)):
                started = time.perf_counter_ns()
                action()
                times[mode].append(time.perf_counter_ns() - started)
    out.write_text(json.dumps({"block": block, "times": times}))
    from tests.support.trainers.common import leave_without_teardown  # PYTHONPATH: the repo

    leave_without_teardown()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(ranks: int, steps: int, block: int, work: Path) -> dict[str, list[int]]:
    """R worker processes; every rank's per-step ns, pooled, the first block left out."""
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(ranks),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        )
        env = {k: v for k, v in env.items() if not k.startswith("CKPTD_")}
        out = work / f"r{ranks}-rank{rank}.json"
        args = [sys.executable, __file__, "_worker", str(out), str(steps), str(block)]
        procs.append((subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL), out))
    pooled: dict[str, list[int]] = {mode: [] for mode in MODES}
    try:
        for proc, _ in procs:
            if proc.wait(timeout=max(120, steps)) != 0:
                raise SystemExit(f"a rank of the {ranks}-rank job exited {proc.returncode}")
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for _, out in procs:
        doc = json.loads(out.read_text())
        for mode in MODES:
            pooled[mode] += doc["times"][mode][block:]  # the first block warms up
    return pooled


def summarise(ranks: int, pooled: dict[str, list[int]]) -> dict[str, Any]:
    def median_us(mode: str) -> float:
        return statistics.median(pooled[mode]) / 1000

    alone, with_ckptd = median_us("none"), median_us("ckptd")
    return {
        "ranks": ranks,
        "steps_per_mode": len(pooled["none"]) // ranks,
        "step_us_without": round(alone, 1),
        "step_us_with": round(with_ckptd, 1),
        "added_us": round(with_ckptd - alone, 1),
        "ratio": round(with_ckptd / alone, 3),
        "agree_only_us": round(median_us("agree only"), 1),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | steps per mode | step alone µs | step + ckptd µs | added µs | ratio "
        "| agreement alone µs |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['steps_per_mode']} | {r['step_us_without']} "
            f"| {r['step_us_with']} | {r['added_us']} | {r['ratio']} | {r['agree_only_us']} |"
        )
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    parser.add_argument("--steps", type=int, default=600, help="steps per mode per rank")
    parser.add_argument("--block", type=int, default=50, help="steps per interleaved block")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    options = parser.parse_args()
    try:
        counts = [int(n) for n in options.ranks.split(",") if n]
    except ValueError:
        parser.error(f"--ranks {options.ranks!r}: give rank counts like 2,4")
    if not counts or min(counts) < 2 or options.steps < 2 * options.block or options.block < 1:
        parser.error("--ranks: counts of 2 or more; --steps: at least two --block")
    cpus = len(os.sched_getaffinity(0))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# Agreement per step, gloo on CPU ({platform.processor() or platform.machine()}, ")
    print(f"# {cpus} CPUs, load average {load} at start, {when})\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-agree-") as tmp:
        for ranks in counts:
            rows.append(summarise(ranks, run_job(ranks, options.steps, options.block, Path(tmp))))
    print(table(rows))
    if options.json:
        options.json.write_text(json.dumps({"when": when, "cpus": cpus, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
