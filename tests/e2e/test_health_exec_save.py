"""``[health] on_degrading = "save"`` under ``ckptd exec`` (docs/health.md): the real PyTorch
trainer, a loop that breaks on ``ckptd.trainer.preempted()`` alone (``--stop-on-any-notice``:
it takes any notice as save-and-stop, as loops written before save-only notices do), saves
and exits 0 on a degrading Xid (a file of ``/dev/kmsg`` records,
tests/support/kernel_lines.py). A save is not a preemption: once its checkpoint commits,
``ckptd exec`` starts the trainer again from it, as after a drill, and the run goes on
instead of ending with the trainer's 0."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from ckptd.devtools.locals3 import LocalS3
from tests.support import kernel_lines as k
from tests.support.daemon import wait_until
from tests.support.exec_harness import ExecNode, trainer_command
from tests.support.harness import Env, TrainerSpec

SPEC = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=100000,
    save_every=100000,  # no routine save: the one committed is the health save's
    step_delay=0.05,
    interruptions=1,
    checkpoint_name="step-{}",
)


def test_a_save_under_exec_restarts_the_trainer_from_its_checkpoint_and_training_goes_on(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    node = ExecNode(
        tmp_path / "node",
        SPEC,
        Env(s3_dest, local_s3.endpoint_url),
        command=[*trainer_command(SPEC, tmp_path / "node"), "--stop-on-any-notice"],
        extra_config="[health]\nenabled = true\npoll_interval_seconds = 0.2\n"
        f'kmsg = {json.dumps(str(kmsg))}\npsi = ""\n',
    )
    try:
        node.start()
        node.wait_progress(lambda d: d["step"] >= 5, 120, "step 5")
        with kmsg.open("a") as out:
            out.write(k.kmsg_record(1, k.XID_63) + "\n")
        (committed,) = wait_until(
            lambda: node.events("checkpoint_committed"), 90, "the save committed"
        )
        wait_until(
            lambda: len(node.events("trainer_started")) == 2,
            90,
            "the trainer started again",
            details=node.log_tail,
        )
        resumed_at = int(committed["checkpoint"].split("-")[1])
        node.wait_progress(lambda d: d["step"] > resumed_at + 3, 120, "training on past the save")
        assert node.alive(), "exec runs on: a save is no preemption"
        assert not node.events("exec_preempted")
        node.signal(signal.SIGTERM)
        node.wait_exit(90)
    finally:
        node.close()
    (event,) = node.events("health_event")
    assert event["kind"] == "xid-63" and event["action"] in ("save", "defer")
    assert len(node.events("health_save_started")) == 1
    started = node.events("trainer_started")
    assert committed["checkpoint"] in json.dumps(started[1])  # resumed from the save
