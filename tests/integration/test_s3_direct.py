"""The direct path of each file's PUT and GET (``ckptd.storage.s3_direct``), on the wire.

Against the real SeaweedFS behind the fault proxy, which records every request with its
headers: after botocore's first request of a kind, the rest go direct, signed the way
botocore signs them (the CRC-32C header signed, the body unsigned), carry the bytes
there and back intact, fail as botocore's fail (so they are retried alike), and where
a proxy is in the environment nothing goes direct at all.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from ckptd.core import checksum
from ckptd.devtools.locals3 import LocalS3
from ckptd.storage import NotFoundError, RetryingStorage
from ckptd.storage.base import StorageError
from ckptd.storage.s3 import S3Storage
from tests.support.faultproxy import FaultProxy, RequestRecord


def _signed(record: RequestRecord) -> set[str]:
    auth = record.header("authorization") or ""
    return set(auth.split("SignedHeaders=", 1)[1].split(",", 1)[0].split(";"))


def _direct(record: RequestRecord) -> bool:
    return (record.header("user-agent") or "").startswith("ckptd/")


def test_after_botocores_first_each_files_put_and_get_go_direct_signed_as_botocore_signs(
    fault_proxy: FaultProxy, s3_prefix: str
) -> None:
    storage = S3Storage("ckpt", s3_prefix, endpoint_url=fault_proxy.url, sse="AES256")
    bodies = {f"dir/file {i}+x.bin": os.urandom(1000 * (i + 1)) for i in range(4)}
    for key, data in bodies.items():
        stored = storage.put_bytes(key, data, crc32c=checksum.crc32c(data))
        # The store's own CRC-32C of what it received, from the reply: no HEAD needed.
        assert checksum.from_base64(stored.checksum) == checksum.crc32c(data)
    for key, data in bodies.items():
        assert storage.get_bytes(key) == data
        pieces: list[tuple[int, bytes]] = []
        storage.stream_range(key, 500, 100, lambda pos, b, into=pieces: into.append((pos, b)))
        assert b"".join(b for _, b in sorted(pieces)) == data[500:600]

    puts = [r for r in fault_proxy.requests if r.method == "PUT"]
    gets = [r for r in fault_proxy.requests if r.method == "GET"]
    # The first PUT taught the path (endpoint, region, credentials): every GET goes direct.
    assert [_direct(r) for r in puts] == [False, True, True, True]
    assert all(_direct(r) for r in gets)
    assert len(fault_proxy.requests) == len(puts) + len(gets) == 4 + 8, "no HEAD, no other"
    for r in puts:
        assert r.header("x-amz-content-sha256") == "UNSIGNED-PAYLOAD"
        assert {"host", "x-amz-checksum-crc32c", "x-amz-date"} <= _signed(r)
        # Server-side encryption goes on every request that makes an object, signed.
        assert r.header("x-amz-server-side-encryption") == "AES256"
        assert "x-amz-server-side-encryption" in _signed(r)
    ranged = [r for r in gets if r.header("range")]
    assert ranged and all("range" in _signed(r) for r in ranged if _direct(r))


def test_direct_failures_are_the_storage_errors_botocores_would_be_and_retried_alike(
    fault_proxy: FaultProxy, s3_prefix: str
) -> None:
    backend = S3Storage("ckpt", s3_prefix, endpoint_url=fault_proxy.url)
    retries: list[tuple[str, str]] = []
    storage = RetryingStorage(
        backend, base_delay=0.01, on_retry=lambda op, exc, n, d: retries.append((op, exc.code))
    )
    data = b"x" * 5000
    storage.put_bytes("first", data, crc32c=checksum.crc32c(data))  # botocore: learns
    assert backend._direct.client is not None
    fault_proxy.fail_next(1, "503-slowdown", methods={"PUT"})
    fault_proxy.fail_next(1, "reset", methods={"GET"})
    storage.put_bytes("second", data, crc32c=checksum.crc32c(data))
    assert storage.get_bytes("second") == data
    # Each failure retried once, under the code botocore's would carry.
    assert retries == [("put", "SlowDown"), ("get", "ConnectionResetError")]
    with pytest.raises(NotFoundError):
        storage.get_bytes("never-written")
    fault_proxy.deny("403-accessdenied", methods={"PUT"})
    with pytest.raises(StorageError) as denied:
        storage.put_bytes("third", data, crc32c=checksum.crc32c(data))
    assert denied.value.destination_unusable and not denied.value.transient
    # A body the store received damaged is refused, and sending it again is the fix.
    fault_proxy.clear_faults()
    with pytest.raises(StorageError) as bad:
        backend.put_bytes("fourth", data, crc32c=checksum.crc32c(b"other"))
    assert bad.value.transient and bad.value.code in (
        "BadDigest",
        "InvalidDigest",
        "XAmzContentSHA256Mismatch",
    )


def test_nothing_goes_direct_where_a_proxy_is_in_the_environment(
    local_s3: LocalS3, fault_proxy: FaultProxy, s3_prefix: str, monkeypatch: Any
) -> None:
    """botocore sends through HTTP_PROXY; the direct path would not, so it declines and
    every request, the tenth file's as the first's, reaches the proxy."""
    monkeypatch.setenv("HTTP_PROXY", fault_proxy.url)
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.delenv("no_proxy", raising=False)
    storage = S3Storage("ckpt", s3_prefix, endpoint_url=local_s3.endpoint_url)
    for i in range(10):
        data = os.urandom(300)
        storage.put_bytes(f"k{i}", data, crc32c=checksum.crc32c(data))
        assert storage.get_bytes(f"k{i}") == data
    assert storage._direct.client is None
    assert fault_proxy.count("PUT") == 10 and fault_proxy.count("GET") == 10
