"""S3 server-side encryption: every request that makes an object asks for it, on the wire.

The real pipeline ships two checkpoints through the fault proxy (recording each request's
headers): the first holds a multipart file and a small one, the second the same
multipart file (copied server-side) and a new small file; then the commit writes each
manifest (conditional PUT) and LATEST. Every PutObject, CreateMultipartUpload and
CopyObject must carry the configured ``x-amz-server-side-encryption`` (and the KMS key
id); UploadPart takes no such header (a part is encrypted as its upload was created),
so the objects themselves are checked too: the store reports each one encrypted. A
restore then reads them back with no header.

SSE-S3 ("AES256") runs against SeaweedFS 4.48, which implements it (PUT, copy and
multipart report AES256); SSE-KMS fails there with InternalError (no KMS configured), so
"aws:kms" runs against moto's server, which accepts and reports a key id.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import boto3
import pytest

from ckptd.config import load_settings
from ckptd.devtools.locals3 import LocalS3
from ckptd.repository import Repository
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_destination
from ckptd.store.restore import RestoreRequest, restore
from ckptd.store.verify import verify_checkpoint
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline
from tests.conftest import BUCKET
from tests.support.daemon import run_cli
from tests.support.faultproxy import FaultProxy, RequestRecord

MiB = 1024 * 1024
SSE_HEADER = "x-amz-server-side-encryption"
KMS_HEADER = "x-amz-server-side-encryption-aws-kms-key-id"


def write_checkpoint(root: Path, name: str, files: dict[str, bytes]) -> None:
    ckpt = root / name
    ckpt.mkdir(parents=True)
    for path, data in files.items():
        (ckpt / path).write_bytes(data)
    (ckpt / "COMPLETE").write_text("")


def kind_of(r: RequestRecord) -> str:
    """The S3 operation a request is, from its method, query and headers."""
    query = r.query
    if r.method == "POST" and "uploads" in query.split("&"):
        return "CreateMultipartUpload"
    if r.method == "POST" and "uploadId=" in query:
        return "CompleteMultipartUpload"
    if r.method == "PUT" and "partNumber=" in query:
        return "UploadPartCopy" if r.header("x-amz-copy-source") else "UploadPart"
    if r.method == "PUT":
        return "CopyObject" if r.header("x-amz-copy-source") else "PutObject"
    return r.method


async def ship_two(
    tmp_path: Path, endpoint: str, dest: str, sse: dict[str, str]
) -> tuple[Any, Path]:
    """Ship ck-1 then ck-2 through ``endpoint`` with encryption ``sse``."""
    watch, state = tmp_path / "watch", tmp_path / "state"
    watch.mkdir()
    state.mkdir()
    settings = load_settings(
        overrides={
            "watch": [
                {"dir": str(watch), "run_id": "run", "layout": "marker", "ship_early": False}
            ],
            "destination": {
                "url": dest,
                "endpoint_url": endpoint,
                "part_size_mib": 5,
                "concurrency": 2,
                "max_attempts": 2,
                **sse,
            },
            "state": {"dir": str(state)},
            "retention": {"keep_last": 0},
        },
        environ={},
    )
    storage = open_destination(settings.destination)
    journal = Journal(state)
    pipeline = SyncPipeline(settings, storage, journal, Metrics())
    big = os.urandom(12 * MiB)  # three 5 MiB parts
    try:
        write_checkpoint(watch, "ck-1", {"weights.bin": big, "config.json": b"{}"})
        await pipeline.evaluate("run", "ck-1")
        assert await pipeline.drain_once()
        write_checkpoint(watch, "ck-2", {"weights.bin": big, "config.json": b'{"a": 1}'})
        await pipeline.evaluate("run", "ck-2")
        assert await pipeline.drain_once()
    finally:
        await pipeline.close()
        journal.close()
    assert [c.manifest.checkpoint for c in Repository(storage).list_committed("run")] == [
        "ck-1",
        "ck-2",
    ]
    return storage, watch


def assert_encrypted_on_the_wire(
    proxy: FaultProxy, algorithm: str, kms_key: str | None
) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in proxy.requests:
        kind = kind_of(r)
        counts[kind] = counts.get(kind, 0) + 1
        if kind in ("PutObject", "CreateMultipartUpload", "CopyObject"):
            assert r.header(SSE_HEADER) == algorithm, f"{kind} {r.path} without SSE"
            assert r.header(KMS_HEADER) == kms_key, f"{kind} {r.path}: KMS key id"
    # Every kind of write happened: the test would pass vacuously otherwise.
    assert counts.get("CreateMultipartUpload", 0) >= 1
    assert counts.get("UploadPart", 0) >= 3
    assert counts.get("CopyObject", 0) >= 1  # ck-2's unchanged weights, server-side
    # Small files, two conditional manifest writes, LATEST twice.
    assert counts.get("PutObject", 0) >= 6
    return counts


def assert_objects_encrypted(client: Any, prefix: str, algorithm: str, kms_key: str | None) -> None:
    keys = [
        o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/run/")["Contents"]
    ]
    data_keys = [k for k in keys if "/ck-" in k]
    assert len(data_keys) >= 6  # two checkpoints x (weights, config, manifest)
    for key in [*data_keys, f"{prefix}/run/LATEST"]:
        head = client.head_object(Bucket=BUCKET, Key=key)
        assert head.get("ServerSideEncryption") == algorithm, key
        if kms_key is not None:
            assert kms_key in head.get("SSEKMSKeyId", ""), key


def restore_and_verify(storage: Any, watch: Path, tmp_path: Path) -> None:
    repo = Repository(storage)
    for name in ("ck-1", "ck-2"):
        manifest = repo.read_manifest("run", name)
        assert verify_checkpoint(storage, manifest) == []
    restore(
        storage,
        RestoreRequest("run", "ck-2", tmp_path / "restored", progress=False, take_lease=False),
    )
    for path in ("weights.bin", "config.json"):
        assert (tmp_path / "restored/ck-2" / path).read_bytes() == (
            watch / "ck-2" / path
        ).read_bytes()


async def test_sse_s3_on_every_put_create_and_copy_against_seaweedfs(
    tmp_path: Path, local_s3: LocalS3, s3_prefix: str, s3_client: Any
) -> None:
    with FaultProxy(local_s3.endpoint_url) as proxy:
        storage, watch = await ship_two(
            tmp_path, proxy.url, f"s3://{BUCKET}/{s3_prefix}", {"sse": "AES256"}
        )
        assert_encrypted_on_the_wire(proxy, "AES256", None)
        proxy.reset_counters()
        restore_and_verify(storage, watch, tmp_path)
        # Reads carry no SSE header (SSE-S3 and KMS need none).
        assert all(r.header(SSE_HEADER) is None for r in proxy.requests)
    assert_objects_encrypted(s3_client, s3_prefix, "AES256", None)


async def test_sse_kms_with_key_id_on_every_put_create_and_copy_against_moto(
    tmp_path: Path, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    key_id = "arn:aws:kms:us-east-1:123456789012:key/ckptd-test"
    with FaultProxy(moto_endpoint) as proxy:
        storage, watch = await ship_two(
            tmp_path,
            proxy.url,
            f"s3://{BUCKET}/kms",
            {"sse": "aws:kms", "sse_kms_key_id": key_id},
        )
        assert_encrypted_on_the_wire(proxy, "aws:kms", key_id)
        restore_and_verify(storage, watch, tmp_path)
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="x",
        aws_secret_access_key="x",
        region_name="us-east-1",
    )
    assert_objects_encrypted(client, "kms", "aws:kms", key_id)


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[destination]\nurl = "file:///mnt/ckpt"\nsse = "AES256"', "destination.sse"),
        (
            '[destination]\nurl = "s3://bucket/p"\nsse = "AES256"\nsse_kms_key_id = "k"',
            "destination.sse_kms_key_id",
        ),
        ('[destination]\nurl = "s3://bucket/p"\nsse = "SSE-C"', "destination.sse"),
    ],
)
def test_misplaced_encryption_is_a_config_error_naming_the_key(
    tmp_path: Path, toml: str, key: str
) -> None:
    config = tmp_path / "ckptd.toml"
    config.write_text(toml + "\n")
    result = run_cli("config", "check", config=config)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], result.stderr
    assert "Traceback" not in result.stderr
