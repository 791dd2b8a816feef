"""``[health] on_degrading = "save"`` under ``ckptd exec`` (docs/health.md): the real PyTorch
trainer, a loop that breaks on ``ckptd.trainer.preempted()`` alone (``--stop-on-any-notice``:
it takes any notice as save-and-stop, as loops written before save-only notices do), saves
and exits 0 on a degrading Xid (a file of ``/dev/kmsg`` records,
tests/support/kernel_lines.py). A save is not a preemption: once its checkpoint commits,
``ckptd exec`` starts the trainer again from it, as after a drill, and the run goes on
instead of ending with the trainer's 0. The stock helper (``preempted()``, then
``stop_requested()``) trains on in the same process instead: no restart at all."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable

from tests.support import kernel_lines as k
from tests.support.daemon import wait_until
from tests.support.harness import TrainerSpec
from tests.support.health_exec import HealthExec

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
    health_exec: Callable[..., HealthExec],
) -> None:
    rig = health_exec(SPEC, trainer_args=["--stop-on-any-notice"])
    node = rig.node
    rig.kernel_logs(k.XID_63)
    (committed,) = wait_until(lambda: node.events("checkpoint_committed"), 90, "the save committed")
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
    (event,) = node.events("health_event")
    assert event["kind"] == "xid-63" and event["action"] in ("save", "defer")
    assert len(node.events("health_save_started")) == 1
    started = node.events("trainer_started")
    assert committed["checkpoint"] in json.dumps(started[1])  # resumed from the save


def test_the_stock_helper_under_exec_saves_and_trains_on_in_the_same_process(
    health_exec: Callable[..., HealthExec],
) -> None:
    rig = health_exec(SPEC)
    node = rig.node
    pid = node.trainer_pid()
    rig.kernel_logs(k.XID_63)
    (committed,) = wait_until(lambda: node.events("checkpoint_committed"), 90, "the save committed")
    saved_at = int(committed["checkpoint"].split("-")[1])
    node.wait_progress(lambda d: d["step"] > saved_at + 5, 120, "training on past the save")
    wait_until(lambda: node.events("health_save_done"), 60, "the save's notice over")
    assert node.alive() and node.trainer_pid() == pid
    assert len(node.events("trainer_started")) == 1, "never restarted"
    assert not node.events("exec_preempted")
    node.signal(signal.SIGTERM)  # a notice: now it saves and stops
    assert node.wait_exit(90) == 0, node.log_tail()
    result = node.result_doc()
    assert result["notice_saves"][0] == saved_at and len(result["notice_saves"]) == 2, result
    assert result["saved"] == f"step-{result['notice_saves'][1]}"
    committed_names = [e["checkpoint"] for e in node.events("checkpoint_committed")]
    assert committed_names == [committed["checkpoint"], result["saved"]]
