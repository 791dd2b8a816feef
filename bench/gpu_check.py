"""The GPU check: real trainers on one GPU under ``ckptd exec``, against a loopback
SeaweedFS started here, no network. On CPU with ``--device cpu`` (the CI variant).

    bench/gpu_check.sh [--device cuda|cpu] [--short] [--repeats N] [--trainers pytorch-dcp,hf-trainer] [--json FILE]

Per trainer (``tests/support/trainers``: ``plain_dcp``, a plain PyTorch loop saving DCP
with ``ckptd.trainer.state``, float32; ``hf_gpt2``, a GPT-2 from a config under the HF
``Trainer`` with ``CkptdCallback``, bf16 autocast on CUDA, float32 on CPU, where bf16
autocast only slows the tiny model), deterministic algorithms on:

1. **without ckptd**: the trainer alone, no listener, no callback, no daemon, to
   ``max_steps``; its final weights are the reference;
2. **with ckptd**: the same trainer under ``ckptd exec`` (daemon, listener, callback, its
   checkpoints shipped as they come), uninterrupted. 1 and 2 alternate ``--repeats``
   times (2 on a GPU), in ABBA order. Step time: the median of the steady-state steps (the first fifth
   of each run left out, the runs pooled), and the inflation
   with ÷ without - 1 (goal: under 1 % on a GPU);
3. **interrupted**: node A under ``ckptd exec``: the trainer gets ``kill -9`` once past
   its first save, ``ckptd exec`` restarts it (kill → first resumed step timed); later a
   spot notice from the fake AWS metadata server (``tests/support/fakes``): the trainer
   saves and exits, the daemon commits (notice → committed timed), node A is gone.
   Node B, fresh directories, ``ckptd exec`` restores that checkpoint and trains to
   ``max_steps`` (start → first resumed step timed). Its final weights must be
   bit-identical to the reference, as must those of run 2.

On a GPU it then reads the health monitor's NVML source (#47) on the real device and
times a poll (``nvml_poll``: wall and CPU per poll, median of 200).

Prints one table and writes the figures to ``--json`` (default
``bench/results/gpu_check-<device>.json``). Exit 1 when a final differs or a step fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: find tests.support
sys.path.insert(0, str(REPO / "bench"))  # and common

from common import BUCKET, use_local_s3_identity  # noqa: E402

from ckptd.devtools.locals3 import LocalS3  # noqa: E402
from tests.support.daemon import wait_until  # noqa: E402
from tests.support.exec_harness import ExecNode, trainer_command  # noqa: E402
from tests.support.fakes.aws_imds import FakeAwsImds  # noqa: E402
from tests.support.harness import Env, TrainerSpec  # noqa: E402
from tests.support.trainers.procs import script_env  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """One trainer's script, its size on this device, and its steps."""

    spec: TrainerSpec
    extra: tuple[str, ...]  # the script's own options: model size, device


def shapes(device: str, short: bool) -> dict[str, Shape]:
    on_gpu = device != "cpu"
    steps, every = (300, 50) if on_gpu else ((40, 10) if short else (120, 10))
    # The CI variant's tiny steps take a millisecond: on a loaded machine the trainer ran
    # past the next save before the kill meant for mid-interval landed. 50 ms a step
    # keeps the kill between saves, as on a GPU.
    delay = 0.05 if short and not on_gpu else 0.0

    def spec(name: str, module: str, checkpoint: str) -> TrainerSpec:
        return TrainerSpec(name, module, steps, every, delay, 2, checkpoint, start_timeout=180)

    plain_size = ("--width", "2048", "--hidden-layers", "4", "--batch", "4096") if on_gpu else ()
    hf_size = ("--preset", "small") if on_gpu else ("--preset", "tiny")
    return {
        "pytorch-dcp": Shape(
            spec("pytorch-dcp", "tests.support.trainers.plain_dcp", "step-{}"),
            ("--device", device, *plain_size),
        ),
        "hf-trainer": Shape(
            spec("hf-trainer", "tests.support.trainers.hf_gpt2", "checkpoint-{}"),
            ("--device", device, *hf_size),
        ),
    }


def steady_gaps(result: dict[str, Any]) -> list[float]:
    """A run's step times (seconds) in its steady state: the first fifth left out."""
    gaps = [b - a for a, b in itertools.pairwise(result["step_ends"])]
    return gaps[max(2, len(gaps) // 5) :]


def event_time(node: ExecNode, name: str, **match: Any) -> float:
    """Wall time of the first ``name`` event whose fields match."""
    for event in node.events(name):
        if all(event.get(k) == v for k, v in match.items()):
            stamp = str(event["timestamp"]).replace("Z", "+00:00")
            return datetime.fromisoformat(stamp).timestamp()
    raise AssertionError(f"no {name} {match} in {node.log_path}:\n{node.log_tail()}")


def run_alone(shape: Shape, work: Path) -> dict[str, Any]:
    """The trainer without ckptd, to the last step; its result document."""
    work.mkdir(parents=True)
    (work / "run").mkdir()
    command = [*trainer_command(shape.spec, work), *shape.extra, "--without-ckptd"]
    with (work / "trainer.log").open("wb") as log:
        done = subprocess.run(
            command, env=script_env(work), cwd=work, stdout=log, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = (work / "trainer.log").read_text(errors="replace")[-4000:]
        raise AssertionError(f"{shape.spec.name} without ckptd exited {done.returncode}:\n{tail}")
    return dict(json.loads((work / "result.json").read_text()))


def exec_node(shape: Shape, work: Path, env: Env, imds_url: str, *extra: str) -> ExecNode:
    """A ``ckptd exec`` of the trainer on a fresh node directory (not started)."""
    node = ExecNode(
        work,
        shape.spec,
        env,
        max_restarts=3,
        preemption=f'provider = "aws"\nendpoint = "{imds_url}"\npoll_interval_seconds = 0.2',
    )
    node.command = [*trainer_command(shape.spec, work), *shape.extra, *extra]
    return node


def run_to_end(node: ExecNode, timeout: float) -> dict[str, Any]:
    try:
        code = node.start().wait_exit(timeout)
    finally:
        node.close()
    if code != 0:
        raise AssertionError(f"ckptd exec exited {code}:\n{node.log_tail()}")
    return node.result_doc()


def weights_equal(a: Path, b: Path) -> bool:
    import torch

    x = torch.load(a, map_location="cpu", weights_only=True)
    y = torch.load(b, map_location="cpu", weights_only=True)
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x
    )


def interrupted(shape: Shape, work: Path, env: Env, imds: FakeAwsImds, url: str) -> dict[str, Any]:
    """Node A: kill -9, restart, notice; node B: fresh, restores, finishes."""
    every = shape.spec.save_every
    kill_at, notice_at = every + every // 2, 2 * every + every // 2 + 2
    a = exec_node(shape, work / "node-a", env, url, "--pause-at", str(notice_at))
    out: dict[str, Any] = {}
    try:
        a.start()
        a.wait_progress(lambda d: d["step"] >= kill_at, 300, f"step {kill_at}")
        pid = a.trainer_pid()
        assert pid is not None
        os.kill(pid, 9)
        killed_at = time.time()
        out["killed_at_step"] = int((a.progress_doc() or {})["step"])
        doc = a.wait_progress(lambda d: d["first_step_at"] > killed_at, 300, "the restart")
        out["kill_to_resumed_s"] = doc["first_step_at"] - killed_at
        out["restarted_from"] = doc["resumed_from"]
        a.wait_progress(lambda d: d["step"] >= notice_at, 300, f"step {notice_at}")
        # The trainer waits at notice_at for the notice. The periodic save before it must
        # be committed first, or the daemon would take it for the emergency checkpoint.
        periodic = shape.spec.checkpoint_name.format(2 * every)
        wait_until(
            lambda: any(e.get("checkpoint") == periodic for e in a.events("checkpoint_committed")),
            300,
            f"{periodic} committed",
            details=a.log_tail,
        )
        noticed_at = time.time()
        imds.trigger_spot("terminate")
        code = a.wait_exit(300)
    finally:
        a.close()
    assert code == 0, f"node A exited {code} after the notice:\n{a.log_tail()}"
    saved = a.result_doc()["saved"]
    out["emergency_checkpoint"] = saved
    out["notice_to_committed_s"] = (
        event_time(a, "checkpoint_committed", checkpoint=saved) - noticed_at
    )
    (emergency,) = a.events("emergency_checkpoint_committed")
    assert emergency["checkpoint"] == saved, emergency
    out["daemon_signalled_after_s"] = emergency.get("signalled_after_s")
    out["daemon_committed_after_s"] = emergency.get("committed_after_s")
    imds.clear_spot()

    b = exec_node(shape, work / "node-b", env, url)
    result = run_to_end(b, 600)
    doc = b.progress_doc() or {}
    out["fresh_node_resumed_from"] = doc.get("resumed_from")
    out["fresh_node_to_first_step_s"] = float(doc.get("first_step_at", 0)) - b.started_wall
    out["final"] = str(b.final)
    assert result["step"] == shape.spec.max_steps, result
    return out


def check(
    shape: Shape, work: Path, env: Env, imds: FakeAwsImds, url: str, repeats: int
) -> dict[str, Any]:
    """One trainer's row: step time without and with ckptd (``repeats`` runs of each,
    alternated, their steady-state steps pooled), the interruptions, and the final
    weights against the reference (the first run without ckptd)."""
    name = shape.spec.name
    without: list[float] = []
    with_: list[float] = []
    reference = work / "alone-0" / "final.pt"
    finals = []
    for i in range(repeats):
        # Alternate which goes first (ABBA...): the first run after a change pays for it.
        for mode in ("without", "with") if i % 2 == 0 else ("with", "without"):
            print(f"[{name}] {mode} ckptd ({i + 1}/{repeats})", file=sys.stderr)
            if mode == "without":
                without += steady_gaps(run_alone(shape, work / f"alone-{i}"))
                continue
            # Its own prefix: node A of the interrupted run must start from nothing.
            with_env = Env(f"{env.dest}-uninterrupted-{i}", env.endpoint_url)
            node = exec_node(shape, work / f"with-{i}", with_env, url)
            with_ += steady_gaps(run_to_end(node, 600))
            finals.append(node.final)
    uninterrupted_identical = all(weights_equal(reference, final) for final in finals)
    print(f"[{name}] kill -9, notice, fresh node", file=sys.stderr)
    row: dict[str, Any] = {"trainer": name, "steps": shape.spec.max_steps}
    row["save_every"] = shape.spec.save_every
    row["repeats"] = repeats
    row["step_ms_without"] = round(statistics.median(without) * 1000, 3)
    row["step_ms_with"] = round(statistics.median(with_) * 1000, 3)
    row["inflation_pct"] = round((row["step_ms_with"] / row["step_ms_without"] - 1) * 100, 2)
    row.update(interrupted(shape, work / "interrupted", env, imds, url))
    row["uninterrupted_identical"] = uninterrupted_identical
    row["identical"] = weights_equal(reference, Path(row.pop("final")))
    return row


def machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "cpus": len(os.sched_getaffinity(0)),
        "cpu": platform.processor() or platform.machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
    }
    if device != "cpu":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def nvml_poll(polls: int = 200) -> dict[str, Any]:
    """#47's NVML source on this machine's real GPUs: what one poll reads (per GPU, the
    fields the device answered), and its cost: the median wall and the CPU of a poll
    (``ckptd.health.nvml.NvmlReader.readings``, as the health monitor calls it)."""
    from ckptd.health.nvml import NvmlReader

    reader = NvmlReader()
    first = reader.readings()
    if reader.unreadable is not None:
        return {"readable": False, "why": reader.unreadable}
    walls = []
    cpu_start = time.process_time()
    for _ in range(polls):
        began = time.perf_counter()
        reader.readings()
        walls.append(time.perf_counter() - began)
    cpu = time.process_time() - cpu_start
    return {
        "readable": True,
        "gpus": [{k: v for k, v in vars(r).items() if v is not None and v != ""} for r in first],
        "polls": polls,
        "wall_ms_per_poll": round(statistics.median(walls) * 1000, 3),
        "cpu_ms_per_poll": round(cpu / polls * 1000, 3),
    }


def table(info: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    where = info.get("gpu") or f"CPU ({info['cpus']} cores)"
    lines = [
        f"GPU check on {where}, torch {info['torch']}, {info['date']}",
        "",
        "| trainer | steps | step ms without | step ms with | inflation | kill -9 → resumed s "
        "| notice → committed s | fresh node → first step s | final weights |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        verdict = "bit-identical" if r["identical"] and r["uninterrupted_identical"] else "DIFFER"
        lines.append(
            f"| {r['trainer']} | {r['steps']} | {r['step_ms_without']:.2f} "
            f"| {r['step_ms_with']:.2f} | {r['inflation_pct']:+.1f} % "
            f"| {r['kill_to_resumed_s']:.2f} | {r['notice_to_committed_s']:.2f} "
            f"| {r['fresh_node_to_first_step_s']:.2f} | {verdict} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="CUDA_VISIBLE_DEVICES picks a GPU"
    )
    parser.add_argument("--short", action="store_true", help="fewer steps (CPU: the CI variant)")
    parser.add_argument(
        "--repeats", type=int, help="runs without and with ckptd, alternated (GPU 2, CPU 1)"
    )
    parser.add_argument("--trainers", default="pytorch-dcp,hf-trainer")
    parser.add_argument("--json", type=Path, help="default: bench/results/gpu_check-<device>.json")
    parser.add_argument("--workdir", type=Path, help="keep the runs' files here")
    options = parser.parse_args()
    if options.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {options.device}: no CUDA here; --device cpu runs on CPU")
    known = shapes(options.device, options.short)
    names = [n for n in options.trainers.split(",") if n]
    if not names or any(n not in known for n in names):
        parser.error(f"--trainers {options.trainers!r}: choose from {', '.join(known)}")
    repeats = options.repeats or (1 if options.device == "cpu" else 2)
    if repeats < 1:
        parser.error(f"--repeats {repeats}: at least 1")
    use_local_s3_identity()
    info = machine(options.device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckptd-gpu-check-") as tmp:
        work = options.workdir or Path(tmp)
        server = LocalS3(work / "seaweedfs", buckets=(BUCKET,)).start()
        imds = FakeAwsImds()
        url = imds.start_in_thread()
        try:
            for name in names:
                env = Env(f"s3://{BUCKET}/gpu-check-{uuid.uuid4().hex[:8]}", server.endpoint_url)
                rows.append(check(known[name], work / name, env, imds, url, repeats))
        finally:
            imds.stop_thread()
            server.stop()
    report = table(info, rows)
    if options.device != "cpu":
        info["nvml"] = nvml_poll()
        report += "\n\nNVML (the health source, #47): " + json.dumps(info["nvml"])
    print(report)
    path = options.json or REPO / "bench" / "results" / f"gpu_check-{options.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    print(f"\nwritten: {path}")
    ok = all(r["identical"] and r["uninterrupted_identical"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
