"""Restore: byte-identical, verified, atomic (nothing at DIR/NAME unless whole), resumable,
and never writing outside the target, against a real SeaweedFS and a real directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
from botocore.exceptions import ClientError

from ckptd import layouts
from ckptd.commit.single import commit
from ckptd.core import checksum
from ckptd.core.manifest import ManifestError, ManifestFile, build_manifest
from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.layouts.base import RuleSettings
from ckptd.repository import LEASE_DIR, Repository, chunk_ranges, manifest_key, object_key
from ckptd.storage import NotFoundError, RetryingStorage, open_storage
from ckptd.store.restore import (
    STAGING_PREFIX,
    RestoreError,
    RestoreRequest,
    environment_differences,
    is_single_file,
    restore,
    staged_parts,
)
from ckptd.store.restore.staging import StateLog
from ckptd.store.retention import apply_retention
from ckptd.store.verify import verify_checkpoint
from ckptd.sync.scanner import snapshot
from tests.support.daemon import run_cli, wait_until, write_config
from tests.support.faultproxy import FaultProxy
from tests.support.writers import local_files, write_bytes, write_dcp, write_deepspeed, write_hf

MiB = 1024 * 1024
BUCKET = "ckpt"


# -- helpers ------------------------------------------------------------------------------


def ship_once(tmp_path: Path, root: Path | list[Path], dest: str, endpoint_url: str = "") -> None:
    """Commit what is complete under ``root`` (one watch dir each) with the real daemon,
    ``ckptd run --once``."""
    roots = root if isinstance(root, list) else [root]
    state = tmp_path / f"state-{roots[0].name}"
    cfg = write_config(
        tmp_path / f"{roots[0].name}.toml",
        watch=[{"dir": r, "settle_seconds": 0} for r in roots],
        dest=dest,
        endpoint_url=endpoint_url,
        state_dir=state,
        port=free_port(),
        part_size_mib=5,
    )
    result = run_cli("run", "--once", config=cfg, timeout=60)
    assert result.returncode == 0, result.stderr


def commit_files(
    storage: RetryingStorage,
    run: str,
    name: str,
    files: dict[str, bytes],
    step: int | None = None,
    committed_at: float | None = None,
) -> None:
    """Upload ``files`` and commit their manifest with ckptd's own commit(), saved and
    committed at ``committed_at`` (default now)."""
    at = time.time() if committed_at is None else committed_at
    for path, data in files.items():
        storage.put_bytes(object_key(run, name, path), data, crc32c=checksum.crc32c(data))
    manifest = build_manifest(
        run_id=run,
        checkpoint=name,
        step=step,
        layout="marker",
        host="test",
        created_at=at,
        committed_at=at,
        files=[(p, len(d), checksum.to_hex(checksum.crc32c(d))) for p, d in files.items()],
        environment={},
    )
    commit(storage, manifest)


def put_raw(s3: Any, prefix: str, key: str, body: bytes) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=body)


def tree_snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: file bytes, or the target of a symlink."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = f"-> {os.readlink(path)}"
            elif path.is_file():
                out[rel] = path.read_bytes()
            else:
                out[rel] = "dir"
    return out


def hostile_manifest(run: str, name: str, paths: list[str]) -> bytes:
    return json.dumps(
        {
            "format": "ckptd.manifest/1",
            "run_id": run,
            "checkpoint": name,
            "step": 1,
            "layout": "hf",
            "host": "evil",
            "created_at": "2026-12-02T12:00:00Z",
            "committed_at": "2026-12-02T12:00:00Z",
            "total_bytes": 4 * len(paths),
            "files": [{"path": p, "size": 4, "crc32c": "00000000"} for p in paths],
        }
    ).encode()


@pytest.fixture
def s3(local_s3: LocalS3, s3_dest: str) -> RetryingStorage:
    return open_storage(s3_dest, endpoint_url=local_s3.endpoint_url, max_attempts=2)


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A directory outside every restore target that nothing may touch."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"untouched")
    return outside


# -- pure ---------------------------------------------------------------------------------


def test_chunk_ranges_cover_the_object_exactly() -> None:
    assert chunk_ranges(0, 4) == []
    assert chunk_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_ranges(8, 4) == [(0, 4), (4, 4)]


def test_environment_differences_name_each_version_that_differs() -> None:
    recorded = {"torch": "2.5.1", "cuda": "12.4", "python": "3.11.7", "ckptd": "0.1.0"}
    here = {"torch": "2.5.1", "python": "3.12.1", "ckptd": "0.2.0"}
    assert environment_differences(recorded, here) == {
        "cuda": ("12.4", None),
        "python": ("3.11.7", "3.12.1"),
    }
    assert environment_differences({}, here) == {}


def test_single_file_checkpoint_is_staged_as_the_file_itself() -> None:
    single = build_manifest(
        run_id="r",
        checkpoint="epoch=1-step=10.ckpt",
        step=10,
        layout="lightning",
        host="h",
        created_at=0,
        committed_at=0,
        files=[("epoch=1-step=10.ckpt", 3, "00000000")],
        environment={},
    )
    assert is_single_file(single)
    assert staged_parts(single, "epoch=1-step=10.ckpt") == ("data",)
    folder = single.model_copy(update={"checkpoint": "checkpoint-10"})
    assert not is_single_file(folder)
    assert staged_parts(folder, "a/b.bin") == ("data", "a", "b.bin")


# -- byte-identical restores of checkpoints committed by the real daemon ----------------


@pytest.mark.parametrize("backend", ["s3", "file"])
def test_hf_dcp_deepspeed_restore_byte_identical(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, backend: str
) -> None:
    dest = s3_dest if backend == "s3" else f"file://{tmp_path / 'shared'}"
    endpoint = local_s3.endpoint_url if backend == "s3" else ""
    for run in ("hf", "dcp", "ds"):
        (tmp_path / run).mkdir()
    written = {
        "hf": write_hf(tmp_path / "hf", 10, model_bytes=12 * MiB),  # multipart: 3 parts
        "dcp": write_dcp(tmp_path / "dcp", 20),  # .metadata: a dot-file that must come back
        "ds": write_deepspeed(tmp_path / "ds", 30),
    }
    ship_once(tmp_path, [tmp_path / run for run in written], dest, endpoint)
    storage = open_storage(dest, endpoint_url=endpoint)
    target = tmp_path / "restored"
    for run, local_dir in written.items():
        # Chunks smaller than the upload's parts and not aligned with them.
        result = restore(
            storage, RestoreRequest(run, None, target, chunk_bytes=3 * MiB, concurrency=4)
        )
        assert result.path == target / local_dir.name
        assert local_files(result.path) == local_files(local_dir), run
        assert result.downloaded_bytes == result.total_bytes
    assert ".metadata" in local_files(target / "step-20")
    # Each restored checkpoint is complete by its own rule (DCP: no shard newer than
    # .metadata, whatever order the downloads finished in): one mtime for every file.
    for name in ("checkpoint-10", "global_step30", "step-20"):
        mtimes = {p.stat().st_mtime_ns for p in (target / name).rglob("*") if p.is_file()}
        assert len(mtimes) == 1, (name, mtimes)
    listing = snapshot(target, "step-20")
    assert listing is not None
    assert layouts.evaluate("dcp", listing, time.time_ns(), RuleSettings()).complete
    # Nothing but the checkpoints themselves and the restore's record of them: no
    # staging dir, no state file left.
    assert sorted(os.listdir(target)) == [".ckptd", "checkpoint-10", "global_step30", "step-20"]
    record = json.loads((target / ".ckptd" / "restored.json").read_text())
    assert sorted(record) == ["checkpoint-10", "global_step30", "step-20"]
    for name, entry in record.items():  # each file as the restore left it
        on_disk = {
            p.relative_to(target / name).as_posix(): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in (target / name).rglob("*")
            if p.is_file()
        }
        assert entry["files"] == on_disk, name
    # The restore leases are gone too.
    assert list(storage.list_objects(f"hf/{LEASE_DIR}/")) == []


def test_lightning_single_file_checkpoint_restores_as_the_file(
    tmp_path: Path, local_s3: LocalS3, s3: RetryingStorage, s3_dest: str
) -> None:
    root = tmp_path / "lit"
    root.mkdir()
    data = write_bytes(root / "epoch=0-step=50.ckpt", 3 * MiB)
    ship_once(tmp_path, root, s3_dest, local_s3.endpoint_url)
    manifest = Repository(s3).resolve("lit", None)
    assert is_single_file(manifest)
    result = restore(s3, RestoreRequest("lit", "epoch=0-step=50.ckpt", tmp_path / "out"))
    restored = tmp_path / "out" / "epoch=0-step=50.ckpt"
    assert result.path == restored and restored.is_file()
    assert restored.read_bytes() == data
    assert sorted(os.listdir(tmp_path / "out")) == [".ckptd", "epoch=0-step=50.ckpt"]


# -- corruption ---------------------------------------------------------------------------


def test_tampered_object_fails_verify_and_restore_leaves_nothing_at_name(
    tmp_path: Path, local_s3: LocalS3, s3: RetryingStorage, s3_client: Any, s3_prefix: str
) -> None:
    files = {"model.bin": os.urandom(5 * MiB), "optim.bin": os.urandom(2 * MiB), "cfg": b"{}"}
    commit_files(s3, "run", "checkpoint-3", files, step=3)
    tampered = bytearray(files["model.bin"])
    tampered[MiB] ^= 0xFF  # same size, one byte different
    put_raw(s3_client, s3_prefix, "run/checkpoint-3/model.bin", bytes(tampered))

    manifest = Repository(s3).resolve("run", "checkpoint-3")
    problems = verify_checkpoint(s3, manifest)
    assert [p.path for p in problems] == ["model.bin"]
    assert "crc32c" in problems[0].problem

    target = tmp_path / "out"
    with pytest.raises(RestoreError) as err:
        restore(s3, RestoreRequest("run", "checkpoint-3", target, chunk_bytes=MiB))
    assert [p.path for p in err.value.problems] == ["model.bin"]
    # Decision: only the hidden staging dir is left, holding nothing but verified files,
    # so a rerun after the store is repaired downloads only what failed.
    assert os.listdir(target) == [f"{STAGING_PREFIX}checkpoint-3"]
    staged = target / f"{STAGING_PREFIX}checkpoint-3" / "data"
    assert sorted(os.listdir(staged)) == ["cfg", "optim.bin"]
    assert (staged / "optim.bin").read_bytes() == files["optim.bin"]

    put_raw(s3_client, s3_prefix, "run/checkpoint-3/model.bin", files["model.bin"])
    verified: list[str] = []
    result = restore(
        s3,
        RestoreRequest("run", "checkpoint-3", target, chunk_bytes=MiB, on_verified=verified.append),
    )
    # The files the first attempt left verified are told first (a shared restore serves
    # them at once), then the one fetched now.
    assert sorted(verified[:2]) == ["cfg", "optim.bin"] and verified[2:] == ["model.bin"]
    assert result.reused_bytes == len(files["optim.bin"]) + 2
    assert result.downloaded_bytes == len(files["model.bin"])
    assert local_files(target / "checkpoint-3") == files
    assert sorted(os.listdir(target)) == [".ckptd", "checkpoint-3"]


@pytest.mark.parametrize("extra", [1, 3 * MiB])
def test_object_larger_than_the_manifest_says_is_refused_before_writing(
    tmp_path: Path, s3: RetryingStorage, s3_client: Any, s3_prefix: str, extra: int
) -> None:
    files = {"model.bin": os.urandom(2 * MiB), "b": b"1234"}
    commit_files(s3, "run", "step-7", files, step=7)
    put_raw(s3_client, s3_prefix, "run/step-7/model.bin", files["model.bin"] + b"x" * extra)
    problems = verify_checkpoint(s3, Repository(s3).resolve("run", None))
    assert [p.path for p in problems] == ["model.bin"] and "size" in problems[0].problem
    target = tmp_path / "out"
    with pytest.raises(RestoreError) as err:
        restore(s3, RestoreRequest("run", None, target))
    assert "larger" in err.value.problems[0].problem
    assert os.listdir(target) == []  # refused before anything was written


def test_missing_object_is_refused_before_writing(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    storage = open_storage(f"file://{shared}")
    commit_files(storage, "run", "ck-1", {"a": b"aaaa", "b/c": b"cc"}, step=1)
    (shared / "run" / "ck-1" / "b" / "c").unlink()
    with pytest.raises(RestoreError) as err:
        restore(storage, RestoreRequest("run", "ck-1", tmp_path / "out"))
    assert [(p.path, p.problem) for p in err.value.problems] == [("b/c", "missing")]
    assert os.listdir(tmp_path / "out") == []


# -- hostile manifests --------------------------------------------------------------------


@pytest.mark.parametrize(
    "paths",
    [
        ["../escape.txt"],
        ["ok.bin", "a/../../escape.txt"],
        ["/tmp/abs-escape.txt"],
        ["a//b"],
        ["./x"],
        ["C:/windows.txt"],
        ["a\\..\\..\\b"],
    ],
)
def test_hostile_manifest_paths_are_refused_before_anything_is_written(
    tmp_path: Path,
    s3: RetryingStorage,
    s3_client: Any,
    s3_prefix: str,
    sentinel: Path,
    paths: list[str],
) -> None:
    # Written straight to the store, bypassing ckptd, objects and all.
    for p in paths:
        with contextlib.suppress(ClientError):  # S3 itself refuses keys with '..'
            put_raw(s3_client, s3_prefix, f"run/evil-1/{p.lstrip('/')}", b"EVIL")
    put_raw(
        s3_client,
        s3_prefix,
        manifest_key("run", "evil-1"),
        hostile_manifest("run", "evil-1", paths),
    )
    put_raw(
        s3_client,
        s3_prefix,
        "run/LATEST",
        b'{"checkpoint": "evil-1", "step": 1, "manifest_crc32c": "00000000"}',
    )
    before = tree_snapshot(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(ManifestError):
        restore(s3, RestoreRequest("run", "evil-1", target))
    # --latest skips a manifest it cannot trust, and then finds nothing committed.
    with pytest.raises(NotFoundError):
        restore(s3, RestoreRequest("run", None, target))
    assert os.listdir(target) == []
    target.rmdir()
    assert tree_snapshot(tmp_path) == before
    assert not Path("/tmp/abs-escape.txt").exists()


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"{}",
        b'{"format": "ckptd.manifest/9"}',
        hostile_manifest("other-run", "evil-1", ["a"]),
    ],
)
def test_unparsable_or_foreign_manifest_is_a_manifest_error(
    tmp_path: Path, s3: RetryingStorage, s3_client: Any, s3_prefix: str, body: bytes
) -> None:
    put_raw(s3_client, s3_prefix, manifest_key("run", "evil-1"), body)
    with pytest.raises(ManifestError):
        restore(s3, RestoreRequest("run", "evil-1", tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before even the target dir was made


def test_existing_target_symlink_to_outside_is_never_written_through(
    tmp_path: Path, s3: RetryingStorage, sentinel: Path
) -> None:
    commit_files(s3, "run", "ck-2", {"a/b": b"data", "keep.txt": b"OVERWRITTEN"}, step=2)
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(sentinel, target / "ck-2")  # DIR/NAME is a link to outside
    before = tree_snapshot(sentinel)
    with pytest.raises(RestoreError, match="already exists"):
        restore(s3, RestoreRequest("run", "ck-2", target))
    with pytest.raises(RestoreError, match="differs"):
        restore(s3, RestoreRequest("run", "ck-2", target, if_missing=True))
    assert tree_snapshot(sentinel) == before
    assert sorted(os.listdir(target)) == ["ck-2"]


def test_symlinks_planted_in_the_staging_dir_are_discarded_not_followed(
    tmp_path: Path, s3: RetryingStorage, sentinel: Path
) -> None:
    files = {"a/b": b"data", "keep.txt": b"OVERWRITTEN"}
    commit_files(s3, "run", "ck-4", files, step=4)
    target = tmp_path / "target"
    staging = target / f"{STAGING_PREFIX}ck-4"
    (staging / "data").mkdir(parents=True)
    # A valid-looking path a/b whose parent 'a' is a link to outside, and a state file
    # that claims a/b is already verified: neither may lead a write outside.
    os.symlink(sentinel, staging / "data" / "a")
    os.symlink(sentinel / "keep.txt", staging / "data" / "keep.txt")
    manifest = Repository(s3).resolve("run", "ck-4")
    from ckptd.store.restore import manifest_identity

    (staging / "state.jsonl").write_text(
        json.dumps({"identity": manifest_identity(manifest)})
        + "\n"
        + json.dumps({"path": "a/b", "size": 4, "crc32c": files_crc(b"data")})
        + "\n"
    )
    (sentinel / "b").write_bytes(b"data")  # so that a/b "exists" with the right size
    before = tree_snapshot(sentinel)
    result = restore(s3, RestoreRequest("run", "ck-4", target))
    assert tree_snapshot(sentinel) == before
    assert result.reused_bytes == 0
    assert local_files(target / "ck-4") == files
    assert not (target / "ck-4" / "a").is_symlink()
    assert sorted(os.listdir(target)) == [".ckptd", "ck-4"]


def test_staging_dir_that_is_a_symlink_is_replaced_not_followed(
    tmp_path: Path, s3: RetryingStorage, sentinel: Path
) -> None:
    commit_files(s3, "run", "ck-5", {"x": b"xx"}, step=5)
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(sentinel, target / f"{STAGING_PREFIX}ck-5")
    before = tree_snapshot(sentinel)
    restore(s3, RestoreRequest("run", "ck-5", target))
    assert tree_snapshot(sentinel) == before
    assert local_files(target / "ck-5") == {"x": b"xx"}


def files_crc(data: bytes) -> str:
    return checksum.to_hex(checksum.crc32c(data))


# -- resume -------------------------------------------------------------------------------


def test_failed_restore_resumes_reusing_verified_files(
    tmp_path: Path, s3_dest: str, s3_client: Any, s3_prefix: str, fault_proxy: FaultProxy
) -> None:
    storage = open_storage(s3_dest, endpoint_url=fault_proxy.url, max_attempts=1)
    files = {f"shard-{i}.bin": os.urandom(3 * MiB) for i in range(4)}
    files["late.bin"] = os.urandom(2 * MiB)
    commit_files(storage, "run", "checkpoint-9", files, step=9)
    # late.bin cannot be read (as if missing); the other files download and verify.
    fault_proxy.deny(
        "403-accessdenied", methods={"GET"}, match=lambda m, p: p.endswith("/late.bin")
    )
    target = tmp_path / "out"
    with pytest.raises(RestoreError) as err:
        restore(storage, RestoreRequest("run", None, target, chunk_bytes=MiB, concurrency=3))
    assert [p.path for p in err.value.problems] == ["late.bin"]
    assert not (target / "checkpoint-9").exists()

    fault_proxy.clear_faults()
    fault_proxy.reset_counters()
    result = restore(storage, RestoreRequest("run", None, target, chunk_bytes=MiB, concurrency=3))
    object_gets = [
        r
        for r in fault_proxy.requests
        if r.method == "GET" and "/checkpoint-9/" in r.path and not r.path.endswith(".json")
    ]
    assert {r.path.rsplit("/", 1)[-1] for r in object_gets} == {"late.bin"}
    assert len(object_gets) == 2  # two 1 MiB ranges
    assert fault_proxy.bytes_down < len(files["late.bin"]) + 64 * 1024
    assert result.reused_bytes == 4 * 3 * MiB and result.downloaded_bytes == 2 * MiB
    assert local_files(target / "checkpoint-9") == files


def test_a_download_cut_half_way_is_fetched_again_whole_and_verifies(
    tmp_path: Path, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    storage = open_storage(s3_dest, endpoint_url=fault_proxy.url)
    files = {"model.bin": os.urandom(3 * MiB + 7), "config.json": b"{}"}
    commit_files(storage, "run", "checkpoint-3", files, step=3)
    # The first GET of model.bin delivers half its body (its first pieces reach the
    # file and the CRC), then the connection drops; the retry starts the range again.
    fault_proxy.fail_next(
        1, "reset-mid-response", methods={"GET"}, match=lambda m, p: p.endswith("/model.bin")
    )
    fault_proxy.reset_counters()

    result = restore(
        storage, RestoreRequest("run", None, tmp_path / "out", chunk_bytes=4 * MiB, concurrency=2)
    )

    gets = [r for r in fault_proxy.requests if r.path.endswith("/model.bin")]
    assert [r.fault for r in gets] == ["reset-mid-response", None]
    assert fault_proxy.bytes_down >= len(files["model.bin"]) * 3 // 2
    assert result.downloaded_bytes == sum(len(b) for b in files.values())
    assert local_files(tmp_path / "out" / "checkpoint-3") == files


_RESTORE_SCRIPT = """
import sys
from pathlib import Path
from ckptd.store.restore import RestoreRequest, restore
from ckptd.storage import open_storage
storage = open_storage(sys.argv[1], endpoint_url=sys.argv[2], max_attempts=1)
restore(storage, RestoreRequest("run", None, Path(sys.argv[3]), chunk_bytes=1 << 20, concurrency=2))
"""


def test_kill_9_mid_restore_resumes_reusing_fsynced_files(
    tmp_path: Path, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    storage = open_storage(s3_dest, endpoint_url=fault_proxy.url, max_attempts=1)
    files = {f"shard-{i}.bin": os.urandom(2 * MiB) for i in range(3)}
    files["stuck.bin"] = os.urandom(2 * MiB)
    commit_files(storage, "run", "checkpoint-11", files, step=11)
    # Every GET of stuck.bin hangs, so the process is mid-restore when it is killed.
    fault_proxy.deny("timeout", methods={"GET"}, match=lambda m, p: p.endswith("/stuck.bin"))
    target = tmp_path / "out"
    state = target / f"{STAGING_PREFIX}checkpoint-11" / "state.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _RESTORE_SCRIPT, s3_dest, fault_proxy.url, str(target)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: state.exists() and len(state.read_text().splitlines()) == 1 + 3,
            30,
            "three files recorded as verified",
        )
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (target / "checkpoint-11").exists()

    fault_proxy.clear_faults()
    fault_proxy.reset_counters()
    result = restore(storage, RestoreRequest("run", None, target, chunk_bytes=MiB))
    assert result.reused_bytes == 3 * 2 * MiB
    assert fault_proxy.bytes_down < 2 * MiB + 64 * 1024
    assert local_files(target / "checkpoint-11") == files


def test_state_records_are_trusted_only_while_the_staged_size_matches(
    tmp_path: Path,
) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    files = {"a.bin": os.urandom(100_000), "b.bin": os.urandom(50_000)}
    commit_files(storage, "run", "ck-3", files, step=3)
    target = tmp_path / "out"
    done: list[str] = []

    class Interrupted(Exception):
        pass

    def stop_after_first(path: str) -> None:
        done.append(path)
        raise Interrupted

    with pytest.raises(Interrupted):
        restore(
            storage, RestoreRequest("run", None, target, on_file=stop_after_first, concurrency=1)
        )
    staged = target / f"{STAGING_PREFIX}ck-3" / "data" / done[0]
    with open(staged, "ab") as fh:  # the file changed after it was recorded
        fh.write(b"!")
    result = restore(storage, RestoreRequest("run", None, target))
    # Its record no longer matches it: fetched again, never reused (a file recorded in
    # the same batch and left as it was may be).
    changed = len(files[done[0]])
    assert result.downloaded_bytes >= changed
    assert result.reused_bytes <= sum(len(b) for b in files.values()) - changed
    assert local_files(target / "ck-3") == files


# -- --if-missing -------------------------------------------------------------------------


def test_if_missing_returns_at_once_when_present_with_matching_sizes(
    tmp_path: Path, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    storage = open_storage(s3_dest, endpoint_url=fault_proxy.url)
    files = {"model.bin": os.urandom(4 * MiB), "n/cfg.json": b"{}"}
    commit_files(storage, "run", "checkpoint-8", files, step=8)
    target = tmp_path / "out"
    first = restore(storage, RestoreRequest("run", None, target, if_missing=True))
    assert not first.skipped
    # What a restore killed between its rename and its clean-up leaves: its staging dir.
    leftover = target / ".ckptd-restore-checkpoint-8"
    leftover.mkdir()
    (leftover / "state.jsonl").write_text('{"identity": "x"}\n')
    fault_proxy.reset_counters()
    again = restore(storage, RestoreRequest("run", None, target, if_missing=True))
    assert again.skipped and again.downloaded_bytes == 0
    assert sorted(p.name for p in target.iterdir()) == [".ckptd", "checkpoint-8"]
    # Only LATEST and the manifest were read: no object, no listing, no lease.
    assert fault_proxy.count("GET") == 2 and fault_proxy.count("PUT") == 0
    assert fault_proxy.bytes_down < 4096
    # Without --if-missing an existing checkpoint is never overwritten.
    with pytest.raises(RestoreError, match="already exists"):
        restore(storage, RestoreRequest("run", None, target))
    # A size that differs is not "present".
    (target / "checkpoint-8" / "n" / "cfg.json").write_bytes(b"{ }")
    with pytest.raises(RestoreError) as err:
        restore(storage, RestoreRequest("run", None, target, if_missing=True))
    assert [p.path for p in err.value.problems] == ["n/cfg.json"]


# -- environment, leases ------------------------------------------------------------------


def test_environment_difference_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    data = b"weights"
    manifest = build_manifest(
        run_id="run",
        checkpoint="ck-1",
        step=1,
        layout="marker",
        host="h",
        created_at=0,
        committed_at=0,
        files=[("w.bin", len(data), files_crc(data))],
        environment={"torch": "2.5.1+cu124", "cuda": "12.4", "python": "3.11.7"},
    )
    storage.put_bytes("run/ck-1/w.bin", data, crc32c=checksum.crc32c(data))
    commit(storage, manifest)
    with structlog.testing.capture_logs() as logs:
        result = restore(
            storage,
            RestoreRequest(
                "run",
                None,
                tmp_path / "out",
                environment={"torch": "2.6.0+cpu", "python": "3.11.7"},
            ),
        )
    assert result.environment_differences == {
        "torch": ("2.5.1+cu124", "2.6.0+cpu"),
        "cuda": ("12.4", None),
    }
    warnings = [e for e in logs if e["event"] == "restore_environment_differs"]
    assert warnings and set(warnings[0]["differences"]) == {"torch", "cuda"}
    assert (tmp_path / "out" / "ck-1" / "w.bin").read_bytes() == data


def test_retention_never_deletes_a_checkpoint_being_restored(
    tmp_path: Path, s3: RetryingStorage
) -> None:
    for step in (1, 2, 3):
        commit_files(
            s3, "run", f"ck-{step}", {"a": os.urandom(1000), "b": os.urandom(10)}, step=step
        )
    seen: list[list[str]] = []

    def retention_runs_meanwhile(path: str) -> None:
        leases = [i.key for i in s3.list_objects(f"run/{LEASE_DIR}/")]
        assert len(leases) == 1 and f"/{LEASE_DIR}/ck-1-" in leases[0]
        seen.append(apply_retention(s3, "run", keep_last=1, keep_every_steps=0))

    result = restore(
        s3, RestoreRequest("run", "ck-1", tmp_path / "out", on_file=retention_runs_meanwhile)
    )
    assert seen[0] == ["ck-2"]  # ck-1 is leased, ck-3 is LATEST
    assert local_files(result.path).keys() == {"a", "b"}
    assert list(s3.list_objects(f"run/{LEASE_DIR}/")) == []
    # Once the restore is over, its checkpoint is fair game again.
    assert apply_retention(s3, "run", keep_last=1, keep_every_steps=0) == ["ck-1"]


def crc_hex(data: bytes) -> str:
    return checksum.to_hex(checksum.crc32c(data))


def test_a_line_cut_short_in_the_state_file_costs_only_that_file(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    files = {"a.bin": os.urandom(70_000), "b.bin": os.urandom(30_000), "c.bin": b"c"}
    commit_files(storage, "run", "ck-6", files, step=6)
    target = tmp_path / "out"
    state = target / f"{STAGING_PREFIX}ck-6" / "state.jsonl"

    class Interrupted(Exception):
        pass

    def stop(path: str) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):  # the files verified and recorded
        restore(storage, RestoreRequest("run", None, target, on_file=stop, concurrency=1))
    header, *records = state.read_bytes().splitlines(keepends=True)
    assert {json.loads(r)["path"] for r in records} == set(files)
    a_line = next(r for r in records if json.loads(r)["path"] == "a.bin")
    # As a crash in the middle of writing c.bin's record leaves it...
    state.write_bytes(header + a_line + b'{"path": "c.b')
    # ...then a rerun records b.bin after the cut line (ending it first).
    staging = os.open(state.parent, os.O_RDONLY)
    try:
        rerun = StateLog(staging, json.loads(header)["identity"], fresh=False)
        rerun.verified(ManifestFile(path="b.bin", size=30_000, crc32c=crc_hex(files["b.bin"])))
        rerun.close()
    finally:
        os.close(staging)
    result = restore(storage, RestoreRequest("run", None, target))
    assert result.reused_bytes == len(files["a.bin"]) + len(files["b.bin"])
    assert result.downloaded_bytes == 1
    assert local_files(target / "ck-6") == files


def test_concurrent_if_missing_restores_into_one_dir_download_once(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    storage = open_storage(f"file://{tmp_path / 'shared'}")
    files = {"w.bin": os.urandom(3 * MiB), "cfg": b"{}"}
    commit_files(storage, "run", "ck-7", files, step=7)
    target = tmp_path / "out"
    with ThreadPoolExecutor(4) as pool:  # e.g. every rank of a node at start-up
        results = list(
            pool.map(
                lambda _: restore(
                    storage, RestoreRequest("run", None, target, if_missing=True, progress=False)
                ),
                range(4),
            )
        )
    assert sorted(r.skipped for r in results) == [False, True, True, True]
    assert local_files(target / "ck-7") == files
    assert sorted(os.listdir(target)) == [".ckptd", "ck-7"]


def test_progress_bar_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = open_storage(f"file://{tmp_path / 'shared'}")
    commit_files(storage, "run", "ck-8", {"w.bin": os.urandom(MiB)}, step=8)
    restore(storage, RestoreRequest("run", None, tmp_path / "out", progress=True))
    err = capsys.readouterr().err
    assert "run/ck-8" in err
    # The same binary units as the summary line (rich's defaults count MB and MB/s).
    assert "MiB" in err and "MiB/s" in err
    assert " MB" not in err and "MB/s" not in err.replace("MiB/s", "")
