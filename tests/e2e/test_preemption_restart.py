"""One notice, one signal, across a daemon's restart (docs/design.md "One notice, one
signal, across restarts"): a spot notice, the trainer saves on the signal, the daemon is
killed with ``kill -9`` into the emergency checkpoint's upload (an OOM kill in the save
burst) and restarted at once, as ``Restart=`` or a pod would. The trainer gets one signal
in all; the notice file is there from the notice on, throughout the restart; the
emergency checkpoint commits before the deadline, byte-identical to what the trainer
wrote."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from tests.support.daemon import Daemon, wait_until
from tests.support.fakes.aws_imds import FakeAwsImds
from tests.support.trainers.procs import script_env
from tests.support.writers import local_files

CAP_MIB_PER_S = 4  # the 16 MiB emergency checkpoint takes ~4 s: the kill lands inside it


def test_a_daemon_killed_mid_emergency_carries_on_with_one_signal(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    record, pidfile = tmp_path / "signals.txt", tmp_path / "trainer.pid"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.trainers.save_on_signal",
            *("--ckpt-dir", str(root), "--pidfile", str(pidfile), "--record", str(record)),
        ],
        env=script_env(tmp_path),
    )
    fake = FakeAwsImds()
    url = fake.start_in_thread()
    seen: list[float] = []
    missing: list[float] = []
    watching = threading.Event()
    try:
        wait_until(pidfile.exists, 30, "the trainer's handler installed")
        daemon = Daemon.configured(
            tmp_path,
            watch=[{"dir": root, "settle_seconds": 0.2}],
            dest=s3_dest,
            endpoint_url=local_s3.endpoint_url,
            state_dir=tmp_path / "state",
            max_upload_mib_per_s=CAP_MIB_PER_S,
        )
        text = daemon.config.read_text().replace('[preemption]\nprovider = "none"', "")
        text += f'[preemption]\nprovider = "aws"\nendpoint = "{url}"\npoll_interval_seconds = 0.2\n'
        text += f'[trainer]\npidfile = "{pidfile}"\n'
        daemon.config.write_text(text)
        notice_file = root / ".ckptd" / "preemption.json"

        def watch_notice_file() -> None:
            while not watching.is_set():
                (seen if notice_file.exists() else missing if seen else []).append(time.time())
                time.sleep(0.005)

        watcher = threading.Thread(target=watch_notice_file, daemon=True)
        watcher.start()
        with daemon:
            fake.trigger_spot("terminate")
            wait_until(
                lambda: daemon.events_named("checkpoint_uploading", checkpoint="checkpoint-101"),
                60,
                "the emergency checkpoint's upload under way",
                details=daemon.log_text,
            )
            time.sleep(1.0)  # into the upload (it takes ~4 s at the cap)
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait(timeout=10)
            assert not daemon.events_named("checkpoint_committed", checkpoint="checkpoint-101")
        again = Daemon(daemon.config, tmp_path / "again.log", daemon.port)
        with again:
            done = wait_until(
                lambda: again.events_named("emergency_checkpoint_committed"),
                60,
                "the emergency checkpoint committed by the restarted daemon",
                details=again.log_text,
            )
            assert again.events_named("notice_carried_over")
            assert not again.events_named("trainer_signalled")
            assert not again.events_named("stale_notice_file_removed")
        watching.set()
        watcher.join(timeout=5)
    finally:
        watching.set()
        fake.stop_thread()
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
    signals = [line.split()[0] for line in record.read_text().splitlines()]
    assert signals == [str(int(signal.SIGUSR1))]  # one signal, across both daemons
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "checkpoint-101"
    ]  # one emergency checkpoint
    assert seen and missing == [], f"notice file missing at {missing[:3]} (first seen {seen[0]})"
    timings: dict[str, Any] = done[0]
    assert timings["checkpoint"] == "checkpoint-101"
    assert timings["committed_before_deadline"] is True
    repo = Repository(open_backend(s3_dest, endpoint_url=local_s3.endpoint_url))
    manifest = repo.resolve("run", "checkpoint-101")
    stored = {
        f.path: repo.storage.get_bytes(object_key("run", manifest.checkpoint, f.path))
        for f in manifest.files
    }
    assert stored == local_files(root / "checkpoint-101")
    assert json.loads(notice_file.read_text())["source"] == "aws"
