"""The destination URL, parsed in one place: ``s3://bucket[/prefix]`` or ``file:///abs/path``.

Configuration validates with ``parse_destination`` and ``open_backend`` opens what it
returns, so the two never disagree on a bucket, a prefix or a root. Pure: no I/O.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote

DestinationKind = Literal["s3", "file"]

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class DestinationURL:
    """What a destination URL names: an S3 bucket and key prefix, or a root directory."""

    kind: DestinationKind
    bucket: str = ""  # s3 only
    prefix: str = ""  # s3 only; without leading or trailing '/', "" for none
    root: Path | None = None  # file only; percent-decoded


def parse_destination(url: str) -> DestinationURL:
    """The parts of a destination URL; ValueError (saying what is wrong) if malformed."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise ValueError(
                "must be s3://bucket[/prefix] with a bucket name of 3-63 characters "
                "a-z 0-9 . -, starting and ending with a letter or digit"
            )
        if ".." in bucket:
            raise ValueError("bucket name must not contain '..'")
        try:
            ipaddress.IPv4Address(bucket)
        except ValueError:
            pass
        else:
            raise ValueError("bucket name must not be an IP address")
        if any(c in prefix for c in "?#\\") or any(ord(c) < 0x20 for c in prefix):
            raise ValueError("prefix must not contain '?', '#', '\\' or control characters")
        prefix = prefix.strip("/")
        # Some S3-compatible servers normalise '.', '..' and '//' in request paths, so such
        # a prefix could address different keys than the ones listed back.
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ValueError("prefix must not contain empty, '.' or '..' segments")
        return DestinationURL("s3", bucket=bucket, prefix=prefix)
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path.startswith("/"):
            raise ValueError("must be file:///absolute/path (three slashes, no host)")
        return DestinationURL("file", root=Path(unquote(path)))
    raise ValueError("must be s3://bucket[/prefix] or file:///absolute/path")
