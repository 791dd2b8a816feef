"""What the trainer's step report costs a step: the step counter against the old report.

    .venv/bin/python bench/bench_steps.py [--calls 20000] [--rounds 7] [--steps 400] [--json FILE]

``ckptd.trainer.report_step(n)``, called after every step, in four modes:

- ``none``: no report at all (a call of an empty function, the loop's own cost);
- ``counter``: what it does now: the memory-mapped step counter ``.ckptd/steps.bin``,
  updated in memory (no system call);
- ``json, every step``: the report before the counter, exact: ``steps.json`` replaced
  (write a temporary file, rename it) at every call (``CKPTD_STEP_REPORT_SECONDS=0``);
- ``json, every 5 s``: the same at its old default: a clock read and a comparison per
  call, the file replaced every 5 s (the steps between two writes were lost to a
  ``kill -9``; the helpers still do this where the counter cannot be mapped).

Part 1: µs per call, median of ``--rounds`` rounds of ``--calls`` calls, the modes
interleaved within each round. Part 2: a stand-in training step (a small MLP's forward,
backward and AdamW step on one thread, ~0.4 ms, torch from the ``trainers`` extra)
followed by the report, median µs per step over ``--steps`` steps per mode and round,
the modes interleaved in blocks of 20 steps. Part 3 (where ``strace`` is installed):
system calls per call, counted by ``strace -f -c`` over a child that makes ``--calls``
reports in one mode, less one that makes none.

The watch dir is a fresh directory under ``--dir`` (default: the system's temporary
directory): put it on the file system a trainer's checkpoints live on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common

from common import machine_line

from ckptd.trainer import steps

MODES = ("none", "counter", "json, every step", "json, every 5 s")
BLOCK = 20  # steps of one mode in a row, in part 2


def _nothing(step: int) -> None:
    pass


def reporter(mode: str, watch: Path) -> Callable[[int], None]:
    """A ``report_step`` in ``mode``, on a fresh watch dir (module doc)."""
    shutil.rmtree(watch, ignore_errors=True)
    watch.mkdir(parents=True)
    steps._forget()
    if mode == "none":
        return _nothing
    if mode == "counter":
        steps.report_step(0, watch)  # the first call maps the file: not what a step pays
    else:
        os.environ["CKPTD_STEP_REPORT_SECONDS"] = "0" if mode == "json, every step" else "5"
        steps._reporter = steps._JsonReport(watch / steps.STEPS_RELPATH, 0, time.time())
        steps._given = watch

    def call(step: int) -> None:
        steps.report_step(step, watch)

    call(1)
    return call


def per_call(watch: Path, calls: int, rounds: int) -> dict[str, float]:
    """Median µs per call of each mode (part 1)."""
    found: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            call = reporter(mode, watch / mode.replace(" ", "_").replace(",", ""))
            started = time.perf_counter_ns()
            for step in range(2, calls + 2):
                call(step)
            found[mode].append((time.perf_counter_ns() - started) / calls / 1000)
    return {m: statistics.median(v) for m, v in found.items()}


def per_step(watch: Path, count: int, rounds: int) -> dict[str, float] | None:
    """Median µs per training step with each mode's report after it (part 2)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 1)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    for _ in range(50):
        step()  # warm
    found: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        # Each mode's reporter made once a round, then swapped in for blocks of BLOCK steps,
        # the modes interleaved block by block: a shared machine's load falls on all alike.
        made = {}
        for mode in MODES:
            call = reporter(mode, watch / mode.replace(" ", "_").replace(",", ""))
            made[mode] = (call, steps._reporter, steps._given)
        for first in range(2, count + 2, BLOCK):
            for mode in MODES:
                call, steps._reporter, steps._given = made[mode]
                for n in range(first, min(first + BLOCK, count + 2)):
                    started = time.perf_counter_ns()
                    step()
                    call(n)
                    found[mode].append((time.perf_counter_ns() - started) / 1000)
    return {m: statistics.median(v) for m, v in found.items()}


def syscalls(watch: Path, calls: int) -> dict[str, float] | None:
    """System calls per call of each mode, by ``strace -f -c`` (part 3); None without it."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    out: dict[str, float] = {}
    baseline = None
    for mode in MODES:
        code = (
            "import sys, time; sys.path.insert(0, sys.argv[1]); import bench_steps as b; "
            "from pathlib import Path; "
            "call = b.reporter(sys.argv[2], Path(sys.argv[3])); "
            "[call(n) for n in range(2, int(sys.argv[4]) + 2)]"
        )
        for n in (0, calls):
            done = subprocess.run(
                [
                    strace,
                    "-f",
                    "-c",
                    sys.executable,
                    "-c",
                    code,
                    str(Path(__file__).parent),
                    mode,
                    str(watch / "strace"),
                    str(n),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            total = re.search(r"^\s*100\.00\s+\S+\s+\S+\s+(\d+)", done.stderr, re.M)
            counted = int(total.group(1)) if total else 0
            if n == 0:
                baseline = counted
            else:
                out[mode] = (counted - (baseline or 0)) / calls
    return out


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--calls", type=int, default=20_000)
    cli.add_argument("--rounds", type=int, default=7)
    cli.add_argument("--steps", type=int, default=400)
    cli.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    cli.add_argument("--json", type=Path, default=None)
    args = cli.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-steps-", dir=args.dir))
    try:
        print(f"# {machine_line()}; watch dir on {work}")
        calls = per_call(work, args.calls, args.rounds)
        trained = per_step(work, args.steps, args.rounds)
        counted = syscalls(work, min(args.calls, 2000))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "\n| mode | µs per call | step + report µs | system calls per call |\n"
        "| --- | ---: | ---: | ---: |"
    )
    for mode in MODES:
        step_us = "-" if trained is None else f"{trained[mode]:.1f}"
        calls_n = "-" if counted is None else f"{counted[mode]:.2f}"
        print(f"| {mode} | {calls[mode]:.2f} | {step_us} | {calls_n} |")
    print(
        f"\nmedians of {args.rounds} rounds of {args.calls} calls; steps: {args.steps} per mode "
        "and round (a 64-128-1 MLP, batch 32, AdamW, one thread)"
    )
    if args.json is not None:
        doc: dict[str, Any] = {
            "machine": machine_line(),
            "per_call_us": calls,
            "per_step_us": trained,
            "syscalls_per_call": counted,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
