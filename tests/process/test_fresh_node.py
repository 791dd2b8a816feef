"""A fresh node resumes from what it restored (docs/design.md "Restored checkpoints and fresh
nodes"): with a quiet window of 20 s (a slow shared filesystem), ``ckptd exec`` restores
``checkpoint-10`` into the empty watch dir and starts the trainer with
``CKPTD_RESUME_FROM`` naming it, at once, not after the window; the daemon takes the
restored checkpoint as committed and never ships it again. How long the start waits is
measured by ``bench/bench_fresh_node.py``."""

from __future__ import annotations

from pathlib import Path

from ckptd.devtools.locals3 import LocalS3, free_port
from tests.support.daemon import run_cli, write_config
from tests.support.fresh_node import fresh_start
from tests.support.writers import write_hf


def test_a_fresh_node_resumes_from_its_restore_whatever_the_quiet_window(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    first = tmp_path / "first"
    write_hf(first / "run", 10)
    config = write_config(
        tmp_path / "first.toml",
        watch=[{"dir": first / "run", "run_id": "run", "settle_seconds": 0}],
        dest=s3_dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=first / "state",
        port=free_port(),
    )
    assert run_cli("run", "--once", config=config).returncode == 0
    node = tmp_path / "fresh"
    start = fresh_start(node, s3_dest, local_s3.endpoint_url, settle_seconds=20.0, port=free_port())
    assert start.code == 0, start.events[-5:]
    assert start.resume == str(node / "run" / "checkpoint-10")
    # Not after the 20 s window: the trainer started within seconds of the restore.
    print(f"restore end -> trainer start: {start.restore_to_start_s:.3f} s")
    assert 0 <= start.restore_to_start_s < 10
    # The daemon knew it committed: nothing of it was shipped again.
    assert start.named("checkpoint_restored_here")
    assert not [
        e for e in start.named("checkpoint_uploading") if e["checkpoint"] == "checkpoint-10"
    ]
