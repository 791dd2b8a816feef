"""A restore's durability by ``syncfs``: a staged file is recorded (and so trusted by a
rerun) only after a sync that covered it, the last sync comes before the rename, and
the restored tree is byte-identical to what was written, with or without ``syncfs``.
Against a real directory (``file://`` store), in a second or two."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest

from ckptd.core.manifest import ManifestFile
from ckptd.storage import open_storage
from ckptd.store.restore import STAGING_PREFIX, RestoreRequest, durability, restore
from ckptd.store.restore.durability import Durability, kernel_at_least
from ckptd.store.restore.staging import StateLog
from tests.integration.test_restore import commit_files
from tests.support.writers import local_files

MiB = 1024 * 1024


class Crash(BaseException):
    """The process dying where it is raised (nothing after it runs, no cleanup counts)."""


def checkpoint(count: int = 40) -> dict[str, bytes]:
    files = {f"__{i}_0.distcp": os.urandom(4096 + 97 * i) for i in range(count)}
    files["sub/big.bin"] = os.urandom(MiB + 12_345)  # past SMALL_FILE_MAX: the ranged path
    files[".metadata"] = os.urandom(1000)
    return files


def state_paths(target: Path, name: str) -> set[str]:
    lines = (target / f"{STAGING_PREFIX}{name}" / "state.jsonl").read_bytes().splitlines()
    return {json.loads(line)["path"] for line in lines[1:]}


@pytest.fixture
def trusted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Restores here use ``syncfs`` whatever filesystem ``tmp_path`` is on; each call is
    logged (``"sync"``) before it runs, so a test can fail or crash it."""
    calls: list[str] = []
    real = durability.syncfs

    def logged(fd: int) -> None:
        calls.append("sync")
        real(fd)

    monkeypatch.setattr(durability, "syncfs_trusted", lambda fd: True)
    monkeypatch.setattr(durability, "syncfs", logged)
    return calls


def test_a_crash_before_the_syncfs_leaves_no_record_and_the_rerun_fetches_again(
    tmp_path: Path, trusted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    files = checkpoint()
    commit_files(storage, "run", "ck-1", files, step=1)
    target = tmp_path / "out"

    def crash(fd: int) -> None:
        raise Crash

    monkeypatch.setattr(durability, "syncfs", crash)
    with pytest.raises(Crash):  # every file written and verified; the sync never ran
        restore(storage, RestoreRequest("run", None, target, progress=False))
    staging = target / f"{STAGING_PREFIX}ck-1"
    assert local_files(staging / "data") == files  # the bytes are there...
    assert state_paths(target, "ck-1") == set()  # ...and none is trusted
    assert not (target / "ck-1").exists()
    # As a power cut may leave an unsynced file: the right size, other bytes.
    (staging / "data" / "__3_0.distcp").write_bytes(os.urandom(len(files["__3_0.distcp"])))
    monkeypatch.undo()
    result = restore(storage, RestoreRequest("run", None, target, progress=False))
    assert result.reused_bytes == 0
    assert result.downloaded_bytes == sum(len(b) for b in files.values())
    assert local_files(target / "ck-1") == files
    assert not staging.exists()


def test_records_come_in_batches_each_after_its_syncfs_and_a_rerun_reuses_only_those(
    tmp_path: Path, trusted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    files = checkpoint()
    commit_files(storage, "run", "ck-2", files, step=2)
    target = tmp_path / "out"
    monkeypatch.setattr(durability, "FLUSH_BYTES", 1)  # a sync for every batch handed on
    real = durability.syncfs
    recorded_at_sync: list[set[str]] = []

    def crash_on_the_second(fd: int) -> None:
        recorded_at_sync.append(state_paths(target, "ck-2"))
        if len(recorded_at_sync) == 2:
            raise Crash
        real(fd)

    monkeypatch.setattr(durability, "syncfs", crash_on_the_second)
    with pytest.raises(Crash):
        restore(storage, RestoreRequest("run", None, target, progress=False, concurrency=1))
    first, second = recorded_at_sync
    assert first == set() and second  # the first batch recorded after its sync, not before
    kept = state_paths(target, "ck-2")
    # The second batch (the small files' last, or big.bin: large files come after the
    # small ones) was written and verified, but its sync never returned: no line.
    assert kept == second and kept < set(files)
    assert "sub/big.bin" not in kept
    result = restore(storage, RestoreRequest("run", None, target, progress=False))
    assert result.reused_bytes == sum(len(files[p]) for p in kept)
    assert result.downloaded_bytes == sum(len(b) for p, b in files.items() if p not in kept)
    assert local_files(target / "ck-2") == files
    # One mtime for all, the reused files' included, as the restore record says.
    record = json.loads((target / ".ckptd" / "restored.json").read_text())["ck-2"]["files"]
    mtimes = {p: (target / "ck-2" / p).stat().st_mtime_ns for p in files}
    assert len(set(mtimes.values())) == 1
    assert {p: m for p, (_, m) in record.items()} == mtimes


def test_one_syncfs_seals_the_restore_before_the_rename(
    tmp_path: Path, trusted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    files = checkpoint(count=200)
    commit_files(storage, "run", "ck-3", files, step=3)
    target = tmp_path / "out"
    real = durability.syncfs
    seen: list[bool] = []

    def look(fd: int) -> None:
        seen.append((target / "ck-3").exists())
        real(fd)

    monkeypatch.setattr(durability, "syncfs", look)
    fsyncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    restore(storage, RestoreRequest("run", None, target, progress=False, take_lease=False))
    assert seen == [False]  # one sync for the whole restore, and before the rename
    # No file is fsynced one by one: only DIR (after the rename, after the staging dir
    # went) and the restore record's file and dir.
    assert len(fsyncs) <= 4
    assert local_files(target / "ck-3") == files


def test_without_a_trusted_syncfs_every_file_is_fsynced_and_recorded_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    files = checkpoint()
    commit_files(storage, "run", "ck-4", files, step=4)
    target = tmp_path / "out"
    monkeypatch.setattr(durability, "syncfs_trusted", lambda fd: False)

    def never(fd: int) -> None:
        raise AssertionError("syncfs where it is not trusted")

    monkeypatch.setattr(durability, "syncfs", never)
    fsyncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    restore(storage, RestoreRequest("run", None, target, progress=False))
    assert len(fsyncs) >= len(files)
    assert local_files(target / "ck-4") == files


def test_a_failed_syncfs_fails_the_restore_with_nothing_in_place(
    tmp_path: Path, trusted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    files = checkpoint(count=5)
    commit_files(storage, "run", "ck-5", files, step=5)
    target = tmp_path / "out"

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "syncfs of the staging filesystem failed: I/O error")

    monkeypatch.setattr(durability, "syncfs", eio)
    with pytest.raises(Exception, match="I/O error"):
        restore(storage, RestoreRequest("run", None, target, progress=False))
    assert not (target / "ck-5").exists()
    assert state_paths(target, "ck-5") == set()


def test_durability_records_only_after_a_sync_and_flushes_when_idle_or_old(
    tmp_path: Path,
) -> None:
    staging = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    now = [0.0]
    recorded: list[str] = []
    try:
        state = StateLog(staging, "id", fresh=True)
        durable = Durability(staging, state, recorded.append, per_file=False, clock=lambda: now[0])
        a, b = (
            ManifestFile(path="a", size=1, crc32c="00000000"),
            ManifestFile(path="b", size=2, crc32c="00000000"),
        )
        for step in range(5):  # a file verified every 0.9 s: never idle, not yet old
            now[0] = step * 0.9
            durable.verified([a])
            durable.tick()
        assert recorded == [] and durable.syncs == 0
        now[0] = durability.FLUSH_SECONDS + 0.1
        durable.verified([a])
        durable.tick()  # the oldest pending waited long enough
        assert recorded == ["a"] * 6 and durable.syncs == 1
        durable.verified([b])
        now[0] += durability.IDLE_SECONDS / 2
        durable.tick()
        assert durable.syncs == 1
        now[0] += durability.IDLE_SECONDS / 2
        durable.tick()  # nothing verified since: a stalled GET holds nothing back
        assert recorded[-1] == "b" and durable.syncs == 2
        now[0] += 100
        durable.tick()  # nothing pending: no sync
        assert durable.syncs == 2
        state.close()
    finally:
        os.close(staging)
    assert (tmp_path / "state.jsonl").read_text().count("\n") == 1 + 7


def test_syncfs_is_trusted_only_on_kernels_that_report_its_errors() -> None:
    assert kernel_at_least("6.18.44-fc-v1300", (5, 8))
    assert kernel_at_least("5.8.0", (5, 8))
    assert not kernel_at_least("5.4.0-150-generic", (5, 8))
    assert not kernel_at_least("4.18.0-553.el8_10.x86_64", (5, 8))
    assert not kernel_at_least("weird", (5, 8))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs is Linux's")
def test_syncfs_reports_its_error() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)  # a closed descriptor: EBADF
    with pytest.raises(OSError) as caught:
        durability.syncfs(fd)
    assert caught.value.errno == errno.EBADF
    assert durability.filesystem_type(fd) is None
