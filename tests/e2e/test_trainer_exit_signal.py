"""A notice's signal that reaches a trainer while it exits must not kill it.

With many nodes this is the common case, not a corner: one node's daemon signals its
ranks, they agree and save, and the other nodes' daemons, one store poll later, signal
theirs while they are already on their way out. Python's finalisation puts a handled
signal back to its default action, and SIGUSR1's default terminates the process: a rank
that saved and exited cleanly would report death by signal (torchrun then fails the job).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.trainers.procs import REPO, script_env


def test_a_trainer_signalled_while_it_exits_still_exits_0(tmp_path: Path) -> None:
    codes = []
    for _ in range(5):
        child = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests/support/trainers/exit_under_signals.py"),
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            env=script_env(tmp_path),
        )
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        while child.poll() is None:  # signal it until the very end of its exit
            try:
                os.kill(child.pid, signal.SIGUSR1)
            except ProcessLookupError:
                break
        codes.append(child.wait(timeout=30))
    assert codes == [0] * 5
