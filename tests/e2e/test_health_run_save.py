"""``[health] on_degrading = "save"`` beside ``ckptd run`` (docs/health.md, "What each
action does"): the real PyTorch trainer with the stock ``ckptd.trainer`` helper
(``preempted()``, then ``stop_requested()`` after the save) saves on each degrading Xid (a
file of ``/dev/kmsg`` records, tests/support/kernel_lines.py) and trains on, the same
process: its helper hears the second health save as it heard the first, and a real
notice (the daemon's SIGTERM, ``sigterm = "notice"``) still makes it save and stop. Each
save for a health event commits byte for byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from tests.support import kernel_lines as k
from tests.support.daemon import Daemon, wait_until
from tests.support.harness import RUN_ID, TrainerProc, TrainerSpec
from tests.support.writers import local_files

SPEC = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=100000,
    save_every=100000,  # no routine save: each one committed is a notice's
    step_delay=0.05,
    interruptions=0,
    checkpoint_name="step-{}",
)


def test_the_stock_helper_saves_on_each_health_save_and_trains_on_then_stops_on_a_notice(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    node = tmp_path / "node"
    ckpt = node / "run"
    ckpt.mkdir(parents=True)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    trainer = TrainerProc(SPEC, node, ckpt, resume=None, hang_at=0)
    daemon = Daemon.configured(
        node,
        watch=[{"dir": ckpt, "run_id": RUN_ID, "settle_seconds": 0.2}],
        dest=s3_dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=node / "state",
    )
    text = daemon.config.read_text()
    assert '[preemption]\nprovider = "none"\n' in text
    daemon.config.write_text(
        text.replace(
            '[preemption]\nprovider = "none"\n',
            '[preemption]\nprovider = "none"\nsigterm = "notice"\n',
        )
        + f"[trainer]\npidfile = {json.dumps(str(trainer.pidfile))}\n"
        + "[health]\nenabled = true\npoll_interval_seconds = 0.2\nsave_interval_seconds = 0\n"
        + f'kmsg = {json.dumps(str(kmsg))}\npsi = ""\n'
    )
    notice_file = ckpt / ".ckptd" / "preemption.json"
    commits: list[dict[str, Any]] = []
    try:
        trainer.wait_step(5, SPEC.start_timeout)
        daemon.start()
        wait_until(lambda: daemon.events_named("ckptd_ready"), 30, "daemon ready")
        for seq in (1, 2):
            with kmsg.open("a") as out:
                out.write(k.kmsg_record(seq, k.XID_63) + "\n")
            wait_until(
                lambda n=seq: len(daemon.events_named("health_save_done")) >= n,
                90,
                f"health save {seq} committed",
                details=daemon.log_text,
            )
            assert len(daemon.events_named("health_save_done")) == seq
            wait_until(lambda: not notice_file.exists(), 30, "the save's notice withdrawn")
            commits = daemon.events_named("checkpoint_committed")
            assert len(commits) == seq, commits
            saved_at = int(commits[-1]["checkpoint"].split("-")[1])
            trainer.wait_step(saved_at + 5, 60)  # trains on past the save
            assert trainer.proc.poll() is None, trainer.log_tail()
        assert daemon.stop(90) == 0, daemon.log_text()
        result = trainer.wait_exit(60)
    finally:
        trainer.kill9()
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.kill9()
    health_saves = [c["checkpoint"] for c in commits]
    # Two saves for the health events, one for the stop; the last is the one it stopped on.
    assert [f"step-{s}" for s in result["notice_saves"]][:2] == health_saves, result
    assert len(result["notice_saves"]) == 3 and result["preempted"], result
    assert result["saved"] == f"step-{result['notice_saves'][-1]}"
    assert len(daemon.events_named("health_save_started")) == 2
    (stop_notice,) = [e for e in daemon.events_named("notice_received") if e["source"] == "sigterm"]
    assert stop_notice["kind"] == "sigterm"
    repo = Repository(open_backend(s3_dest, endpoint_url=local_s3.endpoint_url))
    for name in [*health_saves, result["saved"]]:
        manifest = repo.resolve(RUN_ID, name)
        stored = {
            f.path: repo.storage.get_bytes(object_key(RUN_ID, manifest.checkpoint, f.path))
            for f in manifest.files
        }
        assert stored == local_files(ckpt / name), name
