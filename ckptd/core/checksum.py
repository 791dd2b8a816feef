"""CRC-32C helpers: the manifest's hex form, S3's base64 form, and folding parts together.

The native code is awscrt's (also what botocore's CRT path uses); its ``combine_crc32c``
lets parts checksummed in parallel, or finished before a restart, fold into the
whole-file value without reading a byte twice.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable

from awscrt import checksums as _crt


def crc32c(data: bytes | bytearray | memoryview, previous: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``previous``."""
    return int(_crt.crc32c(data, previous))


def combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32C of A+B from crc(A), crc(B) and len(B)."""
    return int(_crt.combine_crc32c(first, second, second_length))


def combine_parts(parts: Iterable[tuple[int, int]]) -> int:
    """Whole-object CRC-32C from ``(crc, length)`` of each part, in order."""
    total: int | None = None
    for crc, length in parts:
        total = crc if total is None else combine(total, crc, length)
    return 0 if total is None else total


def to_hex(value: int) -> str:
    """The manifest form: 8 lowercase hex digits."""
    return f"{value & 0xFFFFFFFF:08x}"


def from_hex(text: str) -> int:
    if len(text) != 8:
        raise ValueError(f"crc32c must be 8 hex digits, got {text!r}")
    return int(text, 16)


def to_base64(value: int) -> str:
    """The S3 header form (x-amz-checksum-crc32c): base64 of the big-endian 4 bytes."""
    return base64.b64encode((value & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def from_base64(text: str) -> int:
    return int.from_bytes(base64.b64decode(text), "big")


def s3_composite(part_crcs: Iterable[int]) -> str:
    """What S3 reports for a multipart object uploaded with per-part CRC-32C: the CRC of
    the concatenated binary part checksums, then ``-<part count>`` (the COMPOSITE type)."""
    crcs = list(part_crcs)
    joined = b"".join((c & 0xFFFFFFFF).to_bytes(4, "big") for c in crcs)
    return f"{to_base64(crc32c(joined))}-{len(crcs)}"


def s3_checksums_match(reported: str, expected: str) -> bool:
    """Whether a store's reported checksum agrees with ours. Stores differ on the
    ``-<parts>`` suffix of composite values (AWS and SeaweedFS add it, moto does not),
    so the suffix is compared only when the store gives one."""
    got, _, got_parts = reported.partition("-")
    want, _, want_parts = expected.partition("-")
    return got == want and (not got_parts or not want_parts or got_parts == want_parts)
