"""``ckptd exec``, measured: how long from a crash, and from a fresh node, to the trainer's
next (resumed) step, against the <= 30 s that GPU clouds advertise for automatic resume.

    .venv/bin/python bench/bench_exec.py [--trials 10] [--short] [--trainer pytorch-dcp|hf-trainer]

- crash: one ``ckptd exec`` of a real trainer (``tests/support/trainers``); the trainer gets
  ``kill -9`` at a seeded random step, ``--trials`` times. Split: kill -> ckptd has started
  the successor (``trainer_started``), then the successor's start-up to its first step.
- fresh node: a run with a committed checkpoint in the store; each trial is a fresh,
  empty node directory and one ``ckptd exec``. Split: daemon start-up (process start to
  HTTP listening), restore (store lookup, download, verify: to ``trainer_started``), trainer
  start-up (to its first step). The trial then ends with ``kill -9`` of both, so the
  store keeps the same checkpoint for every trial.
A trial succeeds when the trainer resumed from the expected checkpoint. Medians over the
trials; one loopback SeaweedFS (``ckptd.devtools.locals3``) is the store. ``--short``: 3 trials.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: find tests.e2e
sys.path.insert(0, str(REPO / "bench"))  # and common

from common import BUCKET, use_local_s3_identity  # noqa: E402

from ckptd.devtools.locals3 import LocalS3  # noqa: E402
from tests.support.exec_harness import ExecNode, crash_repeatedly  # noqa: E402
from tests.support.harness import Env, TrainerSpec  # noqa: E402

ADVERTISED_S = 30.0
SPECS = {
    "pytorch-dcp": TrainerSpec(
        name="pytorch-dcp",
        module="tests.support.trainers.plain_dcp",
        max_steps=1000,
        save_every=10,
        step_delay=0.02,
        interruptions=0,
        checkpoint_name="step-{}",
    ),
    "hf-trainer": TrainerSpec(
        name="hf-trainer",
        module="tests.support.trainers.hf_gpt2",
        max_steps=1000,
        save_every=10,
        step_delay=0.0,
        interruptions=0,
        checkpoint_name="checkpoint-{}",
    ),
}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def crash_trials(spec: TrainerSpec, work: Path, env: Env, trials: int, seed: int) -> list[str]:
    node = ExecNode(work / "crash", spec, env, max_restarts=trials + 5)
    try:
        node.start()
        crashes = crash_repeatedly(node, trials, random.Random(seed), timeout=180)
        started = node.event_times("trainer_started")[1:]  # the successors
    finally:
        node.close()
    ckptd_s = [t - c.killed_at for c, t in zip(crashes, started, strict=True)]
    trainer_s = [c.restart_s - k for c, k in zip(crashes, ckptd_s, strict=True)]
    total = [c.restart_s for c in crashes]
    ok = [
        c.resumed_step % spec.save_every == 0 and 0 <= c.steps_lost <= spec.save_every
        for c in crashes
    ]
    return [
        f"| crash -> trainer running again | {len(crashes)} | {median(ckptd_s):.2f} "
        f"| - | {median(trainer_s):.2f} | **{median(total):.2f}** | {max(total):.2f} "
        f"| {ADVERTISED_S:.0f} | {100 * sum(ok) / len(ok):.0f} % |"
    ]


def seed_store(spec: TrainerSpec, work: Path, env: Env) -> int:
    """Train until a few checkpoints are committed, then SIGTERM: the emergency one is
    the store's newest. Returns its step."""
    node = ExecNode(work / "seed", spec, env)
    try:
        node.start()
        node.wait_progress(lambda d: d["step"] >= 3 * spec.save_every + 2, 180, "seed steps")
        node.signal(signal.SIGTERM)
        assert node.wait_exit(120) == 0, node.log_tail()
    finally:
        node.close()
    return int(node.result_doc()["step"])


def fresh_trials(spec: TrainerSpec, work: Path, env: Env, trials: int) -> list[str]:
    step = seed_store(spec, work, env)
    slow = replace(spec, step_delay=2.0)  # no new save before the trial ends
    daemon_s, restore_s, trainer_s, total, ok = [], [], [], [], []
    for i in range(trials):
        node = ExecNode(work / f"fresh-{i}", slow, env)
        try:
            node.start()
            doc = node.wait_progress(lambda d: True, 180, "first resumed step")
            listening = node.event_times("http_listening")[0]
            started = node.event_times("trainer_started")[0]
        finally:
            node.close()
        daemon_s.append(listening - node.started_wall)
        restore_s.append(started - listening)
        trainer_s.append(float(doc["first_step_at"]) - started)
        total.append(float(doc["first_step_at"]) - node.started_wall)
        ok.append(doc["resumed_from"] == step)
        print(
            f"  fresh node {i}: {total[-1]:.2f} s, resumed from {doc['resumed_from']}",
            file=sys.stderr,
        )
    return [
        f"| fresh node -> first resumed step | {trials} | {median(daemon_s):.2f} "
        f"| {median(restore_s):.2f} | {median(trainer_s):.2f} | **{median(total):.2f}** "
        f"| {max(total):.2f} | {ADVERTISED_S:.0f} | {100 * sum(ok) / len(ok):.0f} % |"
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--short", action="store_true", help="3 trials each")
    parser.add_argument("--trainer", choices=sorted(SPECS), default="pytorch-dcp")
    parser.add_argument("--seed", type=int, default=20261203)
    options = parser.parse_args()
    trials = 3 if options.short else options.trials
    spec = SPECS[options.trainer]
    use_local_s3_identity()
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-exec-") as tmp:
        work = Path(tmp)
        server = LocalS3(work / "seaweedfs", buckets=(BUCKET,)).start()
        try:
            cpus = len(os.sched_getaffinity(0))
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            rows = []
            env = Env(f"s3://{BUCKET}/bench-exec-{uuid.uuid4().hex[:8]}", server.endpoint_url)
            rows += crash_trials(spec, work, env, trials, options.seed)
            env = Env(f"s3://{BUCKET}/bench-exec-{uuid.uuid4().hex[:8]}", server.endpoint_url)
            rows += fresh_trials(spec, work, env, trials)
        finally:
            server.stop()
    print(f"# ckptd exec, {spec.name} ({cpus} CPUs, load average {load} at start, {began})\n")
    print(
        "| path | trials | ckptd / daemon start-up s | restore s | trainer start-up s "
        "| total s (median) | worst s | advertised s | success |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
