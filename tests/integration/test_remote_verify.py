"""``verify_checkpoint`` (ckptd's ``restic check``): re-read every object and report each
file whose size or CRC-32C differs from its manifest, on SeaweedFS and a real directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from ckptd.repository import RANGE_BYTES as READ_CHUNK
from ckptd.repository import Repository
from ckptd.storage import RetryingStorage, open_storage
from ckptd.store.verify import verify_checkpoint
from tests.integration.test_restore import commit_files, ship_once
from tests.support.writers import write_hf

MiB = 1024 * 1024


def _replace(storage: RetryingStorage, key: str, data: bytes) -> None:
    """Overwrite an object behind ckptd's back (put_bytes checks only transport)."""
    from ckptd.core import checksum

    storage.put_bytes(key, data, crc32c=checksum.crc32c(data))


def _files() -> dict[str, bytes]:
    return {
        # Crosses READ_CHUNK, so the CRC is folded from two ranged reads.
        "model.bin": os.urandom(READ_CHUNK + 123),
        "sub/optim.bin": os.urandom(MiB),
        "empty": b"",
        ".metadata": b"meta",
    }


def test_intact_checkpoint_verifies_clean(storage: RetryingStorage) -> None:
    commit_files(storage, "run", "ck-1", _files(), step=1)
    assert verify_checkpoint(storage, Repository(storage).resolve("run", None)) == []


def test_same_size_different_bytes_is_reported_by_path(storage: RetryingStorage) -> None:
    files = _files()
    commit_files(storage, "run", "ck-2", files, step=2)
    bad = bytearray(files["model.bin"])
    bad[READ_CHUNK + 5] ^= 1  # in the second range
    _replace(storage, "run/ck-2/model.bin", bytes(bad))
    problems = verify_checkpoint(storage, Repository(storage).resolve("run", "ck-2"), concurrency=3)
    assert [p.path for p in problems] == ["model.bin"]
    assert problems[0].problem.startswith("crc32c ")


def test_missing_and_resized_objects_are_reported(storage: RetryingStorage) -> None:
    files = _files()
    commit_files(storage, "run", "ck-3", files, step=3)
    storage.delete(["run/ck-3/.metadata"])
    _replace(storage, "run/ck-3/sub/optim.bin", files["sub/optim.bin"] + b"more")
    _replace(storage, "run/ck-3/empty", b"x")
    problems = {
        p.path: p.problem
        for p in verify_checkpoint(storage, Repository(storage).resolve("run", None))
    }
    assert problems == {
        ".metadata": "missing",
        "empty": "size 1, manifest says 0",
        "sub/optim.bin": f"size {MiB + 4}, manifest says {MiB}",
    }


def test_daemon_committed_multipart_checkpoint_verifies_and_detects_tampering(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, s3_client: Any, s3_prefix: str
) -> None:
    root = tmp_path / "hf"
    root.mkdir()
    ckpt = write_hf(root, 40, model_bytes=11 * MiB)  # 3 parts of 5 MiB
    ship_once(tmp_path, root, s3_dest, local_s3.endpoint_url)
    storage = open_storage(s3_dest, endpoint_url=local_s3.endpoint_url)
    manifest = Repository(storage).resolve("hf", None)
    assert manifest.checkpoint == ckpt.name
    assert verify_checkpoint(storage, manifest) == []
    original = (ckpt / "optimizer.pt").read_bytes()
    s3_client.put_object(
        Bucket="ckpt", Key=f"{s3_prefix}/hf/{ckpt.name}/optimizer.pt", Body=original[::-1]
    )
    assert [p.path for p in verify_checkpoint(storage, manifest)] == ["optimizer.pt"]
