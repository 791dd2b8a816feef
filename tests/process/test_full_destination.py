"""Full disks. A full destination: a checkpoint that does not fit fails with ENOSPC,
leaves nothing behind, and does not hold back a smaller one that fits. A full restore
target: refused before a byte is written.

The small filesystem is a real 60 MiB tmpfs (mounting needs root; skipped otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.writers import write_hf

MiB = 1024 * 1024


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "volume"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _files(root: Path) -> dict[str, int]:
    return {
        p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()
    }


def test_a_checkpoint_too_large_leaves_no_debris_and_a_small_one_still_commits(
    tmp_path: Path, small_volume: Path
) -> None:
    run = tmp_path / "run"
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": run, "settle_seconds": 0}],
        dest=f"file://{small_volume}",
        state_dir=tmp_path / "state",
        part_size_mib=5,
    )
    with daemon:
        write_hf(run, 100, model_bytes=80 * MiB)  # cannot fit in 60 MiB
        wait_until(
            lambda: daemon.events_named("checkpoint_failed", checkpoint="checkpoint-100"),
            60,
            "the large checkpoint failing",
            details=daemon.log_text,
        )
        (failed,) = daemon.events_named("checkpoint_failed", checkpoint="checkpoint-100")[:1]
        assert failed["code"] == "ENOSPC"
        # Nothing of the failed attempt is left: no temporary file, no partial upload,
        # no object of the uncommitted checkpoint.
        wait_until(
            lambda: not _files(small_volume),
            15,
            "the failed attempt's files removed",
            details=lambda: json.dumps(_files(small_volume)),
        )
        # A small checkpoint written now commits while the large one backs off.
        write_hf(run, 101, model_bytes=256 * 1024)
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-101"),
            15,
            "the small checkpoint committed",
            details=daemon.log_text,
        )
        assert (small_volume / "run" / "checkpoint-101" / "ckptd.manifest.json").is_file()
        assert not (small_volume / "run" / "checkpoint-100" / "ckptd.manifest.json").exists()
        assert daemon.metric("ckptd_checkpoints_failed_total", run="run", reason="storage") >= 1


def test_a_restore_that_cannot_fit_is_refused_before_a_byte_is_written(
    tmp_path: Path, small_volume: Path
) -> None:
    """80 MiB into a 60 MiB filesystem: one line with what is free and what is needed,
    exit 1, and the target as it was (no staging dir filling the disk)."""
    from ckptd.storage import open_storage
    from tests.integration.test_restore import commit_files
    from tests.support.daemon import run_cli

    dest = f"file://{tmp_path / 'store'}"
    files = {"a.bin": os.urandom(40 * MiB), "b.bin": os.urandom(40 * MiB)}
    commit_files(open_storage(dest), "run", "ck-9", files, step=9)
    target = small_volume / "run"
    target.mkdir()
    done = run_cli("restore", "--dest", dest, "--run", "run", "--latest", "--to", str(target))
    assert done.returncode == 1
    assert done.stderr.startswith("ckptd: restore failed: ")
    (line,) = done.stderr.splitlines()
    assert "MiB free" in line and "80.0 MiB more" in line and "restore elsewhere" in line
    assert os.listdir(target) == []
    # With room, the same command restores it.
    roomy = tmp_path / "roomy"
    ok = run_cli("restore", "--dest", dest, "--run", "run", "--latest", "--to", str(roomy))
    assert ok.returncode == 0, ok.stderr
    assert (roomy / "ck-9" / "a.bin").read_bytes() == files["a.bin"]
