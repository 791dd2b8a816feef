"""``ckptd exec`` with ``[health]`` on, reading a kernel log the test writes to (a file of
``/dev/kmsg`` records, tests/support/kernel_lines.py), the real PyTorch trainer under it
at its 5th step: what tests/e2e/test_health_exec*.py share (fixture ``health_exec`` in
tests/e2e/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support import kernel_lines as k
from tests.support.exec_harness import ExecNode, trainer_command
from tests.support.harness import Env, TrainerSpec


@dataclass
class HealthExec:
    """One node: ``ckptd exec`` (``node``) and the kernel log its ``[health]`` reads."""

    node: ExecNode
    kmsg: Path
    seq: int = 0

    def kernel_logs(self, line: str) -> None:
        """Append ``line`` to the kernel log as the next record."""
        self.seq += 1
        with self.kmsg.open("a") as out:
            out.write(k.kmsg_record(self.seq, line) + "\n")


def start_health_exec(
    work: Path,
    spec: TrainerSpec,
    env: Env,
    *,
    health: str = "",
    trainer_args: Sequence[str] = (),
) -> HealthExec:
    """Start ``ckptd exec`` in ``work/node`` with ``[health]`` on (poll every 0.2 s, the
    kernel log ``work/kmsg``, no PSI; ``health``: more of its keys, TOML lines), ``spec``'s
    trainer with ``trainer_args`` after its own, and wait for the trainer's 5th step."""
    kmsg = work / "kmsg"
    kmsg.write_text("")
    node = ExecNode(
        work / "node",
        spec,
        env,
        command=[*trainer_command(spec, work / "node"), *trainer_args] if trainer_args else None,
        extra_config="[health]\nenabled = true\npoll_interval_seconds = 0.2\n"
        f'kmsg = {json.dumps(str(kmsg))}\npsi = ""\n{health}',
    )
    rig = HealthExec(node, kmsg)
    try:
        node.start()
        node.wait_progress(lambda d: d["step"] >= 5, 120, "step 5")
    except BaseException:
        node.close()
        raise
    return rig
