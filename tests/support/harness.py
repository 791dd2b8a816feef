"""Interrupt a real trainer under a real daemon, resume it on "fresh nodes", and compare.

Shared by ``tests/e2e/test_lossless_resume.py`` and ``bench/bench_resume.py``.

One *segment* is one node's life: a fresh directory (``<work>/node-<i>/``) holding the
checkpoint dir the daemon watches (``run/``) and the daemon's state dir, a ``ckptd run``
watching it (provider ``aws`` pointed at the fake IMDS), and the trainer, resumed from
what ``ckptd restore --latest`` put there. A segment ends by

- ``notice``: the fake publishes a preemption notice; the daemon signals the trainer,
  which saves and exits 0; the daemon commits that checkpoint; then the node is gone
  (daemon killed, directory wiped);
- ``kill``: the trainer stops at a chosen step (it blocks there: the node froze) once a
  checkpoint of this segment has been committed; trainer and daemon get ``kill -9``
  together and the directory is wiped;
- the trainer reaching the last step (the final segment).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ckptd.layouts.base import step_of
from tests.support.daemon import Daemon, wait_until
from tests.support.fakes.aws_imds import FakeAwsImds
from tests.support.fakes.azure_metadata import FakeAzureMetadata
from tests.support.fakes.gcp_metadata import FakeGcpMetadata
from tests.support.trainers.procs import script_env

RUN_ID = "run"


@dataclass(frozen=True)
class TrainerSpec:
    """A trainer script of ``tests/support/trainers`` and how to drive it."""

    name: str
    module: str
    max_steps: int
    save_every: int
    step_delay: float  # seconds per step, standing in for compute (so notices land mid-run)
    interruptions: int
    checkpoint_name: str  # of a periodic save, "{}" for the step: "step-{}", "step={}.ckpt"
    start_timeout: float = 60.0


PLAIN = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=150,
    save_every=10,
    step_delay=0.01,
    interruptions=3,
    checkpoint_name="step-{}",
)
HF = TrainerSpec(
    name="hf-trainer",
    module="tests.support.trainers.hf_gpt2",
    # Room for a notice that lands late: an idle machine runs ~30 steps of this trainer
    # between the notice and the emergency save, and the next segment still needs a
    # whole save interval and more before its end (run_interrupted's plan).
    max_steps=120,
    save_every=10,
    step_delay=0.0,  # a Trainer step already takes ~20 ms here
    interruptions=2,
    checkpoint_name="checkpoint-{}",
)

LIGHTNING = TrainerSpec(
    name="lightning",
    module="tests.support.trainers.lightning_mc",
    max_steps=100,
    save_every=10,
    step_delay=0.01,
    interruptions=2,
    checkpoint_name="step={}.ckpt",
)


@dataclass
class Interruption:
    kind: str  # "notice" | "kill"
    target_step: int  # notice: sent once the trainer passed it; kill: the step it froze at
    last_step: int  # the last step the trainer finished before the node went away
    restored: str  # the checkpoint the next node got
    restored_step: int
    restore_s: float  # ckptd restore
    resume_s: float  # restore + daemon start + trainer start to its first step

    @property
    def steps_lost(self) -> int:
        return self.last_step - self.restored_step


@dataclass
class ResumeReport:
    trainer: str
    max_steps: int
    save_every: int
    seed: int
    interruptions: list[Interruption] = field(default_factory=list)
    reference_s: float = 0.0
    interrupted_s: float = 0.0
    identical: bool = False
    mismatched: list[str] = field(default_factory=list)


@dataclass
class Env:
    """Where checkpoints go (an S3, gs:// or az:// destination and its endpoint: an
    emulator in tests), and which cloud's preemption notice interrupts the run."""

    dest: str
    endpoint_url: str
    cloud: str = "aws"  # "aws" | "gcp" | "azure": the fake metadata server and provider


class _Notices:
    """The fake metadata server of ``cloud``: publish a preemption notice, withdraw it."""

    def __init__(self, cloud: str) -> None:
        self.cloud = cloud
        self.fake: Any = {"aws": FakeAwsImds, "gcp": FakeGcpMetadata, "azure": FakeAzureMetadata}[
            cloud
        ]()
        self.url = str(self.fake.start_in_thread())
        self._event = ""

    def trigger(self) -> None:
        if self.cloud == "aws":
            self.fake.trigger_spot("terminate")
        elif self.cloud == "gcp":
            self.fake.preempt()
        else:
            self._event = str(self.fake.add_event("Preempt"))

    def clear(self) -> None:
        if self.cloud == "aws":
            self.fake.clear_spot()
        elif self.cloud == "gcp":
            self.fake.set_value("preempted", "FALSE")
        else:
            self.fake.remove_event(self._event)

    def stop(self) -> None:
        self.fake.stop_thread()


class TrainerProc:
    """One trainer process, ended by its PID only."""

    def __init__(
        self,
        spec: TrainerSpec,
        seg: Path,
        ckpt_dir: Path,
        *,
        resume: Path | None,
        hang_at: int,
        pause_at: int = 0,
        step_delay: float | None = None,
    ) -> None:
        self.seg = seg
        self.pidfile = seg / "trainer.pid"
        self.progress = seg / "progress.json"
        self.result = seg / "result.json"
        self.final = seg / "final.pt"
        self.log_path = seg / "trainer.log"
        args = [
            sys.executable,
            "-m",
            spec.module,
            "--ckpt-dir",
            str(ckpt_dir),
            "--pidfile",
            str(self.pidfile),
            "--progress",
            str(self.progress),
            "--result",
            str(self.result),
            "--final",
            str(self.final),
            "--max-steps",
            str(spec.max_steps),
            "--save-every",
            str(spec.save_every),
            "--step-delay",
            str(spec.step_delay if step_delay is None else step_delay),
            "--hang-at",
            str(hang_at),
            "--pause-at",
            str(pause_at),
        ]
        if resume is not None:
            args += ["--resume", str(resume)]
        self.started = time.monotonic()
        self.started_wall = time.time()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                args,
                env=script_env(seg),
                cwd=seg,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def progress_doc(self) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads(self.progress.read_text())
        except (OSError, ValueError):
            return None
        return doc

    def final_written_at(self) -> float:
        return self.final.stat().st_mtime

    def step(self) -> int:
        doc = self.progress_doc()
        return int(doc["step"]) if doc else -1

    def wait_step(self, at_least: int, timeout: float) -> int:
        def reached() -> int | None:
            if self.proc.poll() is not None and self.step() < at_least:
                raise AssertionError(f"trainer exited {self.proc.returncode}:\n{self.log_tail()}")
            step = self.step()
            return step if step >= at_least else None

        return int(wait_until(reached, timeout, f"trainer step {at_least}"))

    def wait_exit(self, timeout: float) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"trainer still running:\n{self.log_tail()}") from None
        assert code == 0, f"trainer exited {code}:\n{self.log_tail()}"
        doc: dict[str, Any] = json.loads(self.result.read_text())
        return doc

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _ckptd_config(path: Path, env: Env, state_dir: Path) -> Path:
    path.write_text(
        f"[destination]\nurl = {json.dumps(env.dest)}\n"
        f"endpoint_url = {json.dumps(env.endpoint_url)}\n"
        f"[state]\ndir = {json.dumps(str(state_dir))}\n"
    )
    return path


def _daemon(seg: Path, ckpt_dir: Path, env: Env, notices_url: str, pidfile: Path) -> Daemon:
    daemon = Daemon.configured(
        seg,
        watch=[{"dir": ckpt_dir, "run_id": RUN_ID, "settle_seconds": 0.2}],
        dest=env.dest,
        endpoint_url=env.endpoint_url,
        state_dir=seg / "state",
    )
    text = daemon.config.read_text().replace('[preemption]\nprovider = "none"', "")
    text += (
        f'[preemption]\nprovider = "{env.cloud}"\nendpoint = "{notices_url}"\n'
        "poll_interval_seconds = 0.2\n"
        f"[trainer]\npidfile = {json.dumps(str(pidfile))}\n"
    )
    daemon.config.write_text(text)
    return daemon


def restore_latest(seg: Path, env: Env, to: Path) -> tuple[str, float]:
    """``ckptd restore --run run --latest --to <to>`` on a fresh node; (checkpoint, seconds)."""
    config = _ckptd_config(seg / "restore.toml", env, seg / "restore-state")
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptd",
            "restore",
            "--run",
            RUN_ID,
            "--latest",
            "--to",
            str(to),
            "--json",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    return str(json.loads(done.stdout)["checkpoint"]), took


def committed(daemon: Daemon, name: str) -> bool:
    return bool(daemon.events_named("checkpoint_committed", checkpoint=name))


def start_reference(spec: TrainerSpec, work: Path) -> TrainerProc:
    """The uninterrupted run (same script, no daemon, no compute delay: the delay changes
    no number); it runs beside the interrupted one."""
    seg = work / "reference"
    ckpt_dir = seg / "run"
    ckpt_dir.mkdir(parents=True)
    return TrainerProc(spec, seg, ckpt_dir, resume=None, hang_at=0, step_delay=0.0)


def finish_reference(spec: TrainerSpec, trainer: TrainerProc) -> tuple[Path, float]:
    """Wait for the reference run; its final weights and how long it took."""
    try:
        result = trainer.wait_exit(180)
    finally:
        trainer.kill9()
    assert result["step"] == spec.max_steps and trainer.final.exists(), result
    return trainer.final, trainer.final_written_at() - trainer.started_wall


def plan(seed: int, count: int) -> list[str]:
    """The kinds of the ``count`` interruptions: both kinds present, order seeded."""
    kinds = ["notice", "kill"] + [random.Random(seed).choice(["notice", "kill"])] * (count - 2)
    random.Random(seed + 1).shuffle(kinds)
    return kinds


def run_interrupted(
    spec: TrainerSpec,
    work: Path,
    env: Env,
    *,
    seed: int,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[Path, list[Interruption], float]:
    """Train to ``max_steps`` across fresh nodes, interrupted as :func:`plan` says."""
    rng = random.Random(seed)
    kinds = plan(seed, spec.interruptions)
    notices = _Notices(env.cloud)
    interruptions: list[Interruption] = []
    started = time.monotonic()
    resume: Path | None = None
    restored_step = 0
    restore_s = 0.0
    final: Path | None = None
    try:
        for index in range(len(kinds) + 1):
            kind = kinds[index] if index < len(kinds) else "finish"
            seg = work / f"node-{index}"
            ckpt_dir = seg / "run"
            seg.mkdir(parents=True)
            segment_started = time.monotonic()
            if index > 0:
                name, restore_s = restore_latest(seg, env, ckpt_dir)
                resume = ckpt_dir / name
                restored_step = step_of(name) or 0
                previous = interruptions[-1]
                previous.restored, previous.restored_step = name, restored_step
                previous.restore_s = restore_s
            else:
                ckpt_dir.mkdir()
            # A step past the next save, never a save step itself: a kill there loses
            # 1..save_every-1 steps, and a notice lands mid-interval.
            every = spec.save_every
            target = restored_step + every + rng.randint(1, 2 * every - 1)
            if target % every == 0:
                target += 1
            assert target < spec.max_steps - every, "plan overruns the run"
            # Trainer and sidecar start together, as in a pod; the daemon finds the
            # trainer by its pidfile when it needs to signal it.
            # A notice's trainer waits at the target for it: how late a loaded machine
            # delivers it must not decide where the next segment starts.
            trainer = TrainerProc(
                spec,
                seg,
                ckpt_dir,
                resume=resume,
                hang_at=target if kind == "kill" else 0,
                pause_at=target if kind == "notice" else 0,
            )
            daemon = _daemon(seg, ckpt_dir, env, notices.url, seg / "trainer.pid")
            try:
                daemon.start()
                trainer.wait_step(restored_step + 1, spec.start_timeout)
                doc = trainer.progress_doc()
                assert doc is not None and doc["resumed_from"] == restored_step
                if index > 0:
                    first_step = doc["first_step_at"] - trainer.started_wall
                    resume_s = (trainer.started - segment_started) + first_step
                    interruptions[-1].resume_s = resume_s
                if kind == "finish":
                    result = trainer.wait_exit(120)
                    assert result["step"] == spec.max_steps and not result["preempted"], result
                    final = trainer.final
                    log(f"  finished at step {spec.max_steps}")
                    break
                if kind == "notice":
                    trainer.wait_step(target, 120)
                    notices.trigger()
                    result = trainer.wait_exit(180)
                    assert result["preempted"] and result["saved"], result
                    last_step = trainer.step()
                    assert result["step"] == last_step
                    saved = str(result["saved"])
                    wait_until(partial(committed, daemon, saved), 180, "emergency commit")
                    notices.clear()
                else:
                    last_step = trainer.wait_step(target, 120)
                    assert last_step == target  # it froze there
                    newest = spec.checkpoint_name.format(target - target % every)
                    wait_until(partial(committed, daemon, newest), 180, f"commit of {newest}")
                    trainer.kill9()
                    daemon.kill9()
                interruptions.append(Interruption(kind, target, last_step, "", -1, 0.0, 0.0))
                log(f"  {kind} at step {last_step} (target {target})")
            finally:
                trainer.kill9()
                if daemon.alive():
                    daemon.kill9()
            # The node is gone, and its disk with it.
            shutil.rmtree(ckpt_dir)
    finally:
        notices.stop()
    assert final is not None
    return final, interruptions, time.monotonic() - started


def compare_weights(reference: Path, resumed: Path) -> list[str]:
    """Names of the tensors that are not bit-identical (empty: all equal)."""
    import torch

    a = torch.load(reference, weights_only=True)
    b = torch.load(resumed, weights_only=True)
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def lossless_resume(
    spec: TrainerSpec, work: Path, env: Env, *, seed: int, log: Callable[[str], None] = print
) -> ResumeReport:
    report = ResumeReport(spec.name, spec.max_steps, spec.save_every, seed)
    reference_run = start_reference(spec, work)
    try:
        final, report.interruptions, report.interrupted_s = run_interrupted(
            spec, work, env, seed=seed, log=log
        )
        reference, report.reference_s = finish_reference(spec, reference_run)
    finally:
        reference_run.kill9()
    report.mismatched = compare_weights(reference, final)
    report.identical = not report.mismatched
    return report


def markdown(report: ResumeReport) -> str:
    lines = [
        f"**{report.trainer}**: {report.max_steps} steps, save every {report.save_every}, "
        f"seed {report.seed}; reference run {report.reference_s:.1f} s, "
        f"interrupted run {report.interrupted_s:.1f} s",
        "",
        "| # | interruption | last step | restored | steps lost | restore (s) "
        "| time to resume (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, it in enumerate(report.interruptions, 1):
        kind = "preemption notice" if it.kind == "notice" else "kill -9 + disk wiped"
        lines.append(
            f"| {i} | {kind} | {it.last_step} | {it.restored} | {it.steps_lost} "
            f"| {it.restore_s:.2f} | {it.resume_s:.2f} |"
        )
    verdict = "bit-identical" if report.identical else f"DIFFER: {report.mismatched[:5]}"
    lines += ["", f"Final weights vs the uninterrupted run: **{verdict}**"]
    return "\n".join(lines)
