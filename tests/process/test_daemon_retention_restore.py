"""The restore command and the daemon's retention, wired end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.writers import local_files, write_hf

MiB = 1024 * 1024


def _committed(s3: Any, prefix: str, run: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="ckpt", Prefix=f"{prefix}/{run}/")
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return sorted(k.split("/")[-2] for k in keys if k.endswith("/ckptd.manifest.json"))


def test_daemon_applies_retention_remote_and_local_after_each_commit(
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
    )
    text = (
        daemon.config.read_text()
        + "[retention]\nkeep_last = 2\nkeep_every_steps = 200\nlocal_keep_last = 1\n"
    )
    daemon.config.write_text(text)
    with daemon:
        for step in (100, 200, 300, 400, 500):
            write_hf(root, step, model_bytes=64 * 1024)
            wait_until(
                lambda s=step: daemon.events_named(
                    "checkpoint_committed", checkpoint=f"checkpoint-{s}"
                ),
                30,
                f"commit of {step}",
            )
        wait_until(
            lambda: (
                _committed(s3_client, s3_prefix, "run")
                == ["checkpoint-200", "checkpoint-400", "checkpoint-500"]
            ),
            20,
            "retention to settle",
        )
        # Locally only the newest is kept, and only committed ones were ever deleted.
        wait_until(
            lambda: (
                sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
                == ["checkpoint-500"]
            ),
            20,
            "local cleanup",
        )
        assert daemon.events_named("retention_deleted")
    # Nothing is left of deleted checkpoints, not even objects without a manifest.
    keys = [
        o["Key"]
        for o in s3_client.list_objects_v2(Bucket="ckpt", Prefix=f"{s3_prefix}/run/").get(
            "Contents", []
        )
    ]
    assert not [k for k in keys if "checkpoint-100/" in k or "checkpoint-300/" in k]


def test_restore_command_is_byte_identical_and_if_missing_is_a_fast_no_op(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    ckpt = write_hf(root, 7, model_bytes=12 * MiB)
    config = tmp_path / "c.toml"
    config.write_text(
        f'[destination]\nurl = "{s3_dest}"\nendpoint_url = "{local_s3.endpoint_url}"\npart_size_mib = 5\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n'
    )
    shipped = run_cli("run", "--once", "--watch", str(root), config=config)
    assert shipped.returncode == 0, shipped.stderr
    target = tmp_path / "fresh-node"
    first = run_cli(
        "restore", "--run", "run", "--latest", "--to", str(target), "--json", config=config
    )
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert doc["checkpoint"] == "checkpoint-7" and not doc["skipped"]
    assert local_files(target / "checkpoint-7") == local_files(ckpt)
    again = run_cli(
        "restore",
        "--run",
        "run",
        "--latest",
        "--to",
        str(target),
        "--if-missing",
        "--json",
        config=config,
    )
    assert again.returncode == 0 and json.loads(again.stdout)["skipped"] is True
    missing = run_cli(
        "restore", "--run", "nope", "--latest", "--to", str(tmp_path / "other"), config=config
    )
    assert missing.returncode == 1 and "nope" in missing.stderr
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())
