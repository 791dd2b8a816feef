"""What ckptd's S3 requests carry on the wire, checked against real SeaweedFS.

Bodies are sent with ``x-amz-content-sha256: UNSIGNED-PAYLOAD``: the CRC-32C header
(itself covered by the signature) is what protects the bytes, so botocore's SHA-256 pass
over every body, its default over plain HTTP, would only burn CPU twice (client and
server) for no extra safety.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckptd.core import checksum
from ckptd.devtools.locals3 import LocalS3
from ckptd.storage.base import FileRange
from ckptd.storage.s3 import S3Storage

MiB = 1024 * 1024


def _capture(storage: S3Storage, operation: str) -> list[dict[str, str]]:
    seen: list[dict[str, str]] = []

    def grab(request: Any, **kwargs: Any) -> None:
        seen.append(
            {
                k.lower(): str(v, "ascii") if isinstance(v, bytes) else v
                for k, v in request.headers.items()
            }
        )

    storage._client.meta.events.register(f"before-send.s3.{operation}", grab)
    return seen


def _signed_headers(headers: dict[str, str]) -> set[str]:
    auth = headers["authorization"]
    return set(auth.split("SignedHeaders=", 1)[1].split(",", 1)[0].split(";"))


def test_bodies_are_unsigned_but_their_crc32c_header_is_signed(
    local_s3: LocalS3, s3_prefix: str, tmp_path: Path
) -> None:
    storage = S3Storage("ckpt", s3_prefix, endpoint_url=local_s3.endpoint_url)
    puts = _capture(storage, "PutObject")
    parts = _capture(storage, "UploadPart")

    small = os.urandom(1000)
    storage.put_bytes("small.bin", small, crc32c=checksum.crc32c(small))
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(6 * MiB))
    upload_id = storage.create_upload("big.bin")
    with open(big, "rb") as fh:
        data = big.read_bytes()
        part = storage.upload_part(
            "big.bin",
            upload_id,
            1,
            0,
            FileRange(fh.fileno(), 0, len(data)),
            crc32c=checksum.crc32c(data),
        )
    stored = storage.complete_upload("big.bin", upload_id, [part])

    for headers in (*puts, *parts):
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert "x-amz-checksum-crc32c" in _signed_headers(headers)
    assert len(puts) == 1 and len(parts) == 1
    # The store accepted both and holds exactly these bytes.
    assert storage.get_bytes("small.bin") == small
    assert storage.get_bytes("big.bin") == data
    assert stored.size == len(data)
