"""Helpers for tests that run a real trainer script as a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.daemon import wait_until

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parent


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for a trainer script: offline, single-threaded, no ckptd leftovers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTD_", "SLURM_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf-home"),
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
        OMP_NUM_THREADS="1",  # the test machine has 2 cores; keep the step rate steady
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class Script:
    """A trainer script running as a child; its output goes to a log file."""

    def __init__(self, tmp_path: Path, name: str, *args: str, env: dict[str, str]) -> None:
        self.log_path = tmp_path / f"{name}.log"
        self.progress = tmp_path / "progress"
        self.result = tmp_path / "result.json"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(SCRIPTS / f"{name}.py"),
                    "--progress",
                    str(self.progress),
                    "--result",
                    str(self.result),
                    *args,
                ],
                env=env,
                cwd=tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def step(self) -> int | None:
        """The last step the script reported, or None before the first."""
        try:
            return int(self.progress.read_text())
        except (OSError, ValueError):
            return None

    def wait_for_step(self, at_least: int, timeout: float) -> int:
        def reached() -> int | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"script exited {self.proc.returncode}:\n{self.log_tail()}")
            step = self.step()
            return step if step is not None and step >= at_least else None

        return wait_until(reached, timeout, f"step {at_least}", 0.02, self.log_tail)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"script still running after {timeout}s:\n{self.log_tail()}"
            ) from None

    def interrupt_at_step(
        self,
        step: int,
        interrupt: Callable[[], object],
        *,
        step_timeout: float,
        exit_timeout: float,
    ) -> None:
        """Wait until the trainer reports ``step``, call ``interrupt`` (a signal, a notice
        file), and require a clean exit 0; the child is killed whatever happens."""
        try:
            self.wait_for_step(step, timeout=step_timeout)
            interrupt()
            assert self.wait_exit(timeout=exit_timeout) == 0, self.log_tail()
        finally:
            self.kill()

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def result_json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.result.read_text())
        return data

    def kill(self) -> None:
        """End the child if it still runs (only this one, by its PID)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a rename, so readers never see half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
