"""``ckptd exec`` around a real trainer of ``tests/support/trainers``: start it, read its
progress, kill the trainer (``kill -9``) at chosen steps, and measure what a restart costs.

Shared by ``tests/process/test_exec.py`` and ``bench/bench_exec.py``. One ``ExecNode`` is one
node's life: a directory holding the watched checkpoint dir (``run/``), the state dir, the
trainer's pid/progress/result files, and one ``ckptd exec`` process (its JSON log in
``exec.log``). The trainer resumes from ``CKPTD_RESUME_FROM`` (``ckptd.trainer.resume_from()``,
the default of the scripts' ``--resume``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from ckptd.devtools.locals3 import free_port
from ckptd.runtime.processes import stat_fields
from tests.support.daemon import read_pid, wait_until
from tests.support.harness import RUN_ID, Env, TrainerSpec
from tests.support.trainers.procs import script_env


def trainer_command(spec: TrainerSpec, node: Path, *, step_delay: float | None = None) -> list[str]:
    ckpt = node / "run"
    return [
        sys.executable,
        "-m",
        spec.module,
        "--ckpt-dir",
        str(ckpt),
        "--pidfile",
        str(node / "trainer.pid"),
        "--progress",
        str(node / "progress.json"),
        "--result",
        str(node / "result.json"),
        "--final",
        str(node / "final.pt"),
        "--max-steps",
        str(spec.max_steps),
        "--save-every",
        str(spec.save_every),
        "--step-delay",
        str(spec.step_delay if step_delay is None else step_delay),
    ]


@dataclass
class Crash:
    """One ``kill -9`` of the trainer under ``ckptd exec``."""

    last_step: int  # the last step the killed trainer finished
    killed_at: float = 0.0  # wall clock
    resumed_step: int = -1  # where its successor started
    restart_s: float = 0.0  # kill -> successor's first step

    @property
    def steps_lost(self) -> int:
        return self.last_step - self.resumed_step


@dataclass
class ExecNode:
    """One ``ckptd exec`` of one trainer on one (fresh) node directory."""

    dir: Path
    spec: TrainerSpec
    env: Env
    max_restarts: int = 10
    step_delay: float | None = None
    shutdown_timeout: float = 30.0
    command: list[str] | None = None
    extra_config: str = ""
    preemption: str = 'provider = "none"'  # the [preemption] section's body
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started_wall: float = 0.0

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.dir / "run"
        self.pidfile = self.dir / "trainer.pid"
        self.progress = self.dir / "progress.json"
        self.result = self.dir / "result.json"
        self.final = self.dir / "final.pt"
        self.log_path = self.dir / "exec.log"
        self.config = self.dir / "ckptd.toml"
        self.config.write_text(
            f"[[watch]]\ndir = {json.dumps(str(self.ckpt))}\nrun_id = {json.dumps(RUN_ID)}\n"
            "settle_seconds = 0.2\n"
            f"[destination]\nurl = {json.dumps(self.env.dest)}\n"
            f"endpoint_url = {json.dumps(self.env.endpoint_url)}\n"
            f"[preemption]\n{self.preemption}\n"
            f'[metrics]\nlisten = "127.0.0.1:{self.port}"\n'
            f"[state]\ndir = {json.dumps(str(self.dir / 'state'))}\n" + self.extra_config
        )

    # -- the process -------------------------------------------------------------------

    def start(self) -> ExecNode:
        command = self.command or trainer_command(self.spec, self.dir, step_delay=self.step_delay)
        args = [
            sys.executable,
            "-m",
            "ckptd",
            "exec",
            "--config",
            str(self.config),
            "--max-restarts",
            str(self.max_restarts),
            "--shutdown-timeout",
            str(self.shutdown_timeout),
            "--",
            *command,
        ]
        self.started_wall = time.time()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                args,
                env=script_env(self.dir),
                cwd=self.dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ckptd exec still running:\n{self.log_tail()}") from None

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def close(self) -> None:
        """Kill what is left (a failed test): ckptd exec, then its trainer's process group.

        The pidfile alone missed a trainer that exec had just restarted and that had not
        written its pidfile yet: it ran on as an orphan. exec starts each trainer in a
        session of its own, so the groups of exec's children are taken before exec dies."""
        groups = set()
        pid = self.trainer_pid()
        if pid is not None and _alive(pid):
            groups.add(_group_of(pid))
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    groups.add(_group_of(child.pid))
            self.proc.kill()
            self.proc.wait()
        for group in groups - {None, os.getpgrp()}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)  # type: ignore[arg-type]
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)

    # -- what it shows -----------------------------------------------------------------

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if name is None or doc.get("event") == name:
                    out.append(doc)
        return out

    def event_times(self, name: str) -> list[float]:
        """Wall-clock times (epoch seconds) of each ``name`` event, oldest first."""
        return [
            datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            for e in self.events(name)
        ]

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return json.loads(r.read())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def trainer_pid(self) -> int | None:
        return read_pid(self.pidfile)

    def progress_doc(self) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads(self.progress.read_text())
        except (OSError, ValueError):
            return None
        return doc

    def result_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.result.read_text())
        return doc

    def wait_progress(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            if not self.alive():
                raise AssertionError(
                    f"ckptd exec exited while waiting for {what}:\n{self.log_tail()}"
                )
            doc = self.progress_doc()
            return doc if doc is not None and predicate(doc) else None

        return dict(wait_until(check, timeout, what, interval=0.01, details=self.log_tail))


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed trainer whose exec has not reaped it yet)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def crash_repeatedly(
    node: ExecNode, crashes: int, rng: random.Random, timeout: float
) -> list[Crash]:
    """``kill -9`` the trainer ``crashes`` times, each at a random step after its first new
    save is complete (so every attempt makes progress) and before the second. Returns
    each crash, with where the successor resumed and how long it took to run again."""
    spec = node.spec
    out: list[Crash] = []
    since = 0.0  # a progress doc of the current attempt has first_step_at >= this
    for _ in range(crashes):
        doc = node.wait_progress(
            lambda d, since=since: d["first_step_at"] >= since, timeout, "the trainer's first step"
        )
        resumed = int(doc["resumed_from"])
        if out:
            out[-1].resumed_step = resumed
            out[-1].restart_s = float(doc["first_step_at"]) - since
        # After step resumed+save_every the trainer saves; its next step is reported once
        # that save is complete, so killing at or after that step loses < 1 save interval.
        target = resumed + spec.save_every + rng.randint(1, spec.save_every - 1)
        assert target < spec.max_steps, f"max_steps too small for {crashes} crashes"
        node.wait_progress(lambda d, t=target: d["step"] >= t, timeout, f"step {target}")
        pid = node.trainer_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        since = time.time()
        wait_until(lambda p=pid: not _alive(p), 10, f"trainer {pid} gone")
        last = node.progress_doc()
        assert last is not None
        out.append(Crash(last_step=int(last["step"]), killed_at=since))
    doc = node.wait_progress(
        lambda d: d["first_step_at"] >= since, timeout, "the last successor's first step"
    )
    out[-1].resumed_step = int(doc["resumed_from"])
    out[-1].restart_s = float(doc["first_step_at"]) - since
    return out


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
