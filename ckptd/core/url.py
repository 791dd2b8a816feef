"""The destination URL, parsed in one place: ``s3://bucket[/prefix]``, ``gs://bucket[/prefix]``,
``az://container[/prefix]`` (the account from configuration or the environment, as
adlfs and object_store take it) or ``file:///abs/path``.

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

DestinationKind = Literal["s3", "gs", "az", "file"]

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# GCS bucket names also take '_' (Cloud Storage, "Bucket naming requirements").
_GCS_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
# Google Cloud Storage's endpoints: its S3 (XML) API ignores If-None-Match on a PUT.
GOOGLE_STORAGE_HOSTS = ("storage.googleapis.com", "storage.cloud.google.com")


def is_google_storage_host(host: str) -> bool:
    """Whether ``host`` is Google Cloud Storage's (any case, a trailing dot, a regional
    or bucket-style subdomain)."""
    name = host.strip().rstrip(".").lower()
    return any(name == h or name.endswith("." + h) for h in GOOGLE_STORAGE_HOSTS)


# Azure container names: 3-63 of a-z 0-9 -, starting with a letter or digit, no "--".
_CONTAINER = re.compile(r"[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]")
_ALL_FORMS = (
    "must be s3://bucket[/prefix], gs://bucket[/prefix], az://container[/prefix] "
    "or file:///absolute/path"
)


@dataclass(frozen=True)
class DestinationURL:
    """What a destination URL names: a bucket (S3 or GCS) and key prefix, or a root
    directory."""

    kind: DestinationKind
    bucket: str = ""  # s3 and gs; for az, the container
    prefix: str = ""  # s3, gs and az; without leading or trailing '/', "" for none
    root: Path | None = None  # file only; percent-decoded


def parse_destination(url: str) -> DestinationURL:
    """The parts of a destination URL; ValueError (saying what is wrong) if malformed."""
    if url.startswith("s3://"):
        return _bucket_url(url, "s3", _BUCKET)
    if url.startswith("gs://"):
        return _bucket_url(url, "gs", _GCS_BUCKET)
    if url.startswith("az://"):
        return _bucket_url(url, "az", _CONTAINER)
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path.startswith("/"):
            raise ValueError("must be file:///absolute/path (three slashes, no host)")
        return DestinationURL("file", root=Path(unquote(path)))
    raise ValueError(_ALL_FORMS)


def _bucket_url(url: str, scheme: DestinationKind, pattern: re.Pattern[str]) -> DestinationURL:
    bucket, _, prefix = url[len(scheme) + 3 :].partition("/")
    if scheme == "az" and not pattern.fullmatch(bucket):
        raise ValueError(
            "must be az://container[/prefix] with a container name of 3-63 characters "
            "a-z 0-9 -, starting and ending with a letter or digit, without '--'"
        )
    if not pattern.fullmatch(bucket):
        extra = " _" if scheme == "gs" else ""
        raise ValueError(
            f"must be {scheme}://bucket[/prefix] with a bucket name of 3-63 characters "
            f"a-z 0-9 . -{extra}, starting and ending with a letter or digit"
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
    return DestinationURL(scheme, bucket=bucket, prefix=prefix)
