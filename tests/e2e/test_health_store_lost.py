"""The store lost for longer than ``[health] unreachable_seconds`` (docs/health.md): a real
``ckptd run`` and a real trainer that saves on SIGUSR1 and trains on, SeaweedFS on
loopback behind a proxy that cuts every connection (tests/support/faultproxy.py) for the
outage. The trainer saves locally; the checkpoint ships once the link returns, and what
the store holds is byte for byte what the trainer wrote."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from ckptd.devtools.locals3 import LocalS3
from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from tests.support.daemon import Daemon, wait_until
from tests.support.faultproxy import FaultProxy
from tests.support.trainers.procs import script_env
from tests.support.writers import local_files

UNREACHABLE_SECONDS = 3


def test_a_store_lost_past_the_threshold_makes_a_local_save_shipped_when_it_returns(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    record, pidfile = tmp_path / "signals.txt", tmp_path / "trainer.pid"
    trainer = subprocess.Popen(
        [
            *(sys.executable, "-m", "tests.support.trainers.save_on_signal"),
            *("--ckpt-dir", str(root), "--pidfile", str(pidfile)),
            *("--record", str(record), "--mib", "2"),
        ],
        env=script_env(tmp_path),
    )
    try:
        wait_until(pidfile.exists, 30, "the trainer's handler installed")
        daemon = Daemon.configured(
            tmp_path,
            watch=[{"dir": root, "settle_seconds": 0.2}],
            dest=s3_dest,
            endpoint_url=fault_proxy.url,
            state_dir=tmp_path / "state",
        )
        daemon.config.write_text(
            daemon.config.read_text()
            + f'[trainer]\npidfile = "{pidfile}"\n'
            + '[health]\nenabled = true\npoll_interval_seconds = 0.2\nkmsg = ""\npsi = ""\n'
            + f"unreachable_seconds = {UNREACHABLE_SECONDS}\n"
        )
        with daemon:
            wait_until(lambda: daemon.events_named("ckptd_ready"), 30, "the daemon ready")
            fault_proxy.deny("reset")  # the link cut: every connection reset
            (event,) = wait_until(
                lambda: daemon.events_named("health_event", kind="store-unreachable"),
                30,
                "the store's loss heard past the threshold",
                details=daemon.log_text,
            )
            assert event["severity"] == "degrading" and event["action"] in ("save", "defer")
            wait_until(
                lambda: (root / "checkpoint-101" / "trainer_state.json").exists(),
                30,
                "the trainer's local save",
            )
            assert not daemon.events_named("checkpoint_committed", checkpoint="checkpoint-101")
            fault_proxy.clear_faults()  # the link back
            wait_until(
                lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-101"),
                60,
                "the local save shipped once the store returned",
                details=daemon.log_text,
            )
            wait_until(lambda: daemon.events_named("health_save_done"), 30, "the save's end")
            assert trainer.poll() is None, "the trainer trains on"
            assert len(record.read_text().splitlines()) == 1
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
    repo = Repository(open_backend(s3_dest, endpoint_url=local_s3.endpoint_url))
    manifest = repo.resolve("run", "checkpoint-101")
    stored = {
        f.path: repo.storage.get_bytes(object_key("run", manifest.checkpoint, f.path))
        for f in manifest.files
    }
    assert stored == local_files(root / "checkpoint-101")
