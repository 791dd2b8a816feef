"""``[health] on_degrading = "save-and-stop"`` under ``ckptd exec`` (docs/health.md): a
degrading Xid in the kernel log (a file of ``/dev/kmsg`` records,
tests/support/kernel_lines.py) is a notice: the real PyTorch trainer saves, the
checkpoint commits, the trainer is not started again and ``ckptd exec`` exits 0, the
code launchers act on, as after a cloud's notice. The run ledger says the attempt was
interrupted by ``health``, a cause of its own."""

from __future__ import annotations

from collections.abc import Callable

from ckptd.devtools.locals3 import LocalS3
from ckptd.goodput.journal import read_ledger
from ckptd.goodput.model import Mark, goodput
from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from tests.support import kernel_lines as k
from tests.support.harness import RUN_ID, TrainerSpec
from tests.support.health_exec import HealthExec
from tests.support.writers import local_files

SPEC = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=400,
    save_every=1000,  # no routine save: the one committed is the health event's
    step_delay=0.05,
    interruptions=1,
    checkpoint_name="step-{}",
)


def test_save_and_stop_is_a_notice_the_trainer_saves_and_exec_exits_0(
    health_exec: Callable[..., HealthExec], local_s3: LocalS3, s3_dest: str
) -> None:
    rig = health_exec(SPEC, health='on_degrading = "save-and-stop"\n')
    node = rig.node
    rig.kernel_logs(k.XID_63)
    code = node.wait_exit(90)
    assert code == 0, node.log_tail()
    (event,) = node.events("health_event")
    assert (event["kind"], event["action"]) == ("xid-63", "save-and-stop")
    (notice,) = node.events("notice_received")
    assert (notice["source"], notice["kind"]) == ("health", "health-stop")
    saved = node.result_doc()["saved"]
    assert saved in [e["checkpoint"] for e in node.events("checkpoint_committed")]
    assert len(node.events("trainer_started")) == 1  # stopped, not restarted
    (preempted,) = node.events("exec_preempted")
    assert preempted["committed"] is True and preempted["emergency_checkpoint"] == saved
    repo = Repository(open_backend(s3_dest, endpoint_url=local_s3.endpoint_url))
    manifest = repo.resolve(RUN_ID, saved)
    stored = {
        f.path: repo.storage.get_bytes(object_key(RUN_ID, manifest.checkpoint, f.path))
        for f in manifest.files
    }
    assert stored == local_files(node.ckpt / saved)
    marks = [r for r in read_ledger(repo, RUN_ID) if isinstance(r, Mark)]
    assert [m.detail for m in marks if m.kind == "notice"] == ["health"]
    assert [m.detail for m in marks if m.kind == "interrupted"] == ["health"]
    assert [i.cause for i in goodput(read_ledger(repo, RUN_ID)).interruptions] == ["health"]
