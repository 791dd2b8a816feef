"""The store's link cut on the namespace rig (tests/support/netns.py), past
``[health] unreachable_seconds`` (docs/health.md): SeaweedFS in a host of its own, the
daemon in another, a real trainer that saves on SIGUSR1 and trains on. The store's link
goes down (no FIN, no RST: it vanishes); the daemon hears the loss, the trainer saves
locally; the link comes back, the checkpoint ships, and the store holds the trainer's
bytes. Skips where namespaces cannot be made (not root)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import boto3

from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY, LocalS3, free_port
from tests.support.daemon import Daemon, wait_until
from tests.support.netns import Shape, rig_or_skip
from tests.support.trainers.procs import script_env
from tests.support.writers import local_files

S3_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
}


def test_the_stores_link_cut_makes_a_local_save_shipped_byte_identical_when_it_returns(
    tmp_path: Path,
) -> None:
    with rig_or_skip() as rig:
        store_host = rig.add_host("store", Shape())
        s3 = LocalS3(
            tmp_path / "seaweedfs",
            buckets=("ckpt",),
            ip=store_host.address,
            wrap=tuple(store_host.argv([])),
        )
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        s3.start(timeout=60)
        trainer: subprocess.Popen[bytes] | None = None
        daemon: Daemon | None = None
        try:
            node = rig.add_host("node-0", Shape())
            root = tmp_path / "run"
            root.mkdir()
            pidfile, record = tmp_path / "trainer.pid", tmp_path / "signals"
            trainer = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.support.trainers.save_on_signal"),
                    *("--ckpt-dir", str(root), "--pidfile", str(pidfile)),
                    *("--record", str(record), "--mib", "2"),
                ],
                env=script_env(tmp_path),
            )
            wait_until(pidfile.exists, 30, "the trainer's handler installed")
            port = free_port()
            config = tmp_path / "ckptd.toml"
            config.write_text(
                f'[[watch]]\ndir = {json.dumps(str(root))}\nrun_id = "run"\n'
                "settle_seconds = 0.2\n"
                f'[destination]\nurl = "s3://ckpt/health"\n'
                f"endpoint_url = {json.dumps(s3.endpoint_url)}\n"
                '[preemption]\nprovider = "none"\n'
                f'[metrics]\nlisten = "{node.address}:{port}"\n'
                f"[state]\ndir = {json.dumps(str(tmp_path / 'state'))}\n"
                f"[trainer]\npidfile = {json.dumps(str(pidfile))}\n"
                '[health]\nenabled = true\npoll_interval_seconds = 0.2\nkmsg = ""\npsi = ""\n'
                "unreachable_seconds = 3\n"
            )
            daemon = Daemon(
                config,
                tmp_path / "ckptd.log",
                port,
                host=node.address,
                wrap=node.argv([]),
                env=dict(S3_ENV),
            ).start()
            wait_until(lambda: daemon.events_named("ckptd_ready"), 30, "the daemon ready")
            rig.link(store_host, up=False)  # the store vanishes: no FIN, no RST
            (event,) = wait_until(
                lambda: daemon.events_named("health_event", kind="store-unreachable"),
                60,
                "the store's loss heard past the threshold",
                details=daemon.log_text,
            )
            assert event["action"] in ("save", "defer")  # deferred past a save in progress
            wait_until(
                lambda: (root / "checkpoint-101" / "trainer_state.json").exists(),
                30,
                "the trainer's local save",
            )
            assert not daemon.events_named("checkpoint_committed")
            rig.link(store_host, up=True)
            wait_until(
                lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-101"),
                120,
                "the local save shipped once the link returned",
                details=daemon.log_text,
            )
            assert trainer.poll() is None, "the trainer trains on"
            assert len(record.read_text().splitlines()) == 1
            client = boto3.client(
                "s3",
                endpoint_url=s3.endpoint_url,
                aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY,
                region_name="us-east-1",
            )
            stored = {
                name: client.get_object(Bucket="ckpt", Key=f"health/run/checkpoint-101/{name}")[
                    "Body"
                ].read()
                for name in local_files(root / "checkpoint-101")
            }
            assert stored == local_files(root / "checkpoint-101")
        finally:
            if daemon is not None:
                daemon.__exit__()
            if trainer is not None:
                trainer.send_signal(signal.SIGKILL)
                trainer.wait(timeout=10)
            s3.stop()
