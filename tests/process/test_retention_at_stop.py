"""A SIGTERM's flush commits without a retention pass (a notice's seconds go to commits,
not deletes); the daemon runs that pass before it exits, so the store holds what the
policy keeps once the daemon is gone (issue 45: 4 checkpoints with ``keep_last = 3``)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, wait_until

MiB = 1024 * 1024


def _save(root: Path, step: int, size: int) -> None:
    ckpt = root / f"checkpoint-{step}"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(bytes([step % 251]) * size)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def _committed(s3: Any, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="ckpt", Prefix=f"{prefix}/run/")
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    names = []
    for key in keys:
        if key.endswith("/ckptd.manifest.json"):
            doc = json.loads(s3.get_object(Bucket="ckpt", Key=key)["Body"].read())
            if doc.get("format") == "ckptd.manifest/1":
                names.append(key.split("/")[-2])
    return sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]))


def test_the_flush_after_sigterm_is_followed_by_a_retention_pass(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": root, "settle_seconds": 0}],
        dest=s3_dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=tmp_path / "state",
        max_upload_mib_per_s=4,
    )
    daemon.env = {"CKPTD_RETENTION__KEEP_LAST": "3"}
    daemon.extra_args = ["--shutdown-timeout", "60"]
    with daemon:
        for step in (1, 2, 3):
            _save(root, step, 64 * 1024)
            wait_until(
                lambda s=step: daemon.events_named(  # type: ignore[misc]
                    "checkpoint_committed", checkpoint=f"checkpoint-{s}"
                ),
                60,
                f"checkpoint-{step} committed",
                details=daemon.log_text,
            )
        _save(root, 4, 12 * MiB)  # 3 s at the cap: SIGTERM lands mid-upload
        wait_until(
            lambda: daemon.metric("ckptd_upload_bytes_total", run="run") > 0.5 * MiB,
            60,
            "checkpoint-4 uploading",
        )
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=120) == 0, daemon.log_text()
    assert daemon.events_named("flushed_on_sigterm")
    assert _committed(s3_client, s3_prefix) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert daemon.events_named("retention_deleted", checkpoint="checkpoint-1")
