"""What a push reads and how it fails, whichever way its chunks travel (HTTP or stream).

- ``read_chunk`` / ``read_chunk_into``: one chunk of a local file, with its CRC-32C (and
  1 MiB block digests, authenticated) computed from the very buffer that is sent, and the
  file's identity: a file no longer as listed (size, mtime) is ``PeerError("changed")``;
- ``FileState``: per file, what the holder took (each chunk's CRC-32C and blocks) and
  the identity of its first read, which every later read must match;
- ``chunk_refusal``: what an answer to a chunk means: sent again (dropped, 5xx, damaged
  fewer than ``DAMAGED_SENDS`` times), or the push fails, with a ``PeerError`` whose
  ``reason`` is the metric's label.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core import checksum, digest
from ckptd.core.errors import CkptdError
from ckptd.peers.own import Identity, identity_of

#: Sends of one damaged (422) chunk before the push gives up: a link that damages every
#: body is not one to keep a replica through.
DAMAGED_SENDS = 5


class PeerError(CkptdError):
    """A push or a question a peer did not answer as it must; ``reason`` says how."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class PeerRestartedError(PeerError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "restarted")


class PeerAbandonedError(PeerError):
    """The push was given up on its holder (``ckptd.peers.client``): ``why`` is "notice"
    (it has one), "silent" (it answered nothing) or "stalled" (it took no chunk)."""

    def __init__(self, message: str, why: str, after: float) -> None:
        super().__init__(message, "abandoned")
        self.why = why
        self.after = after  # seconds into the push


@dataclass(frozen=True)
class LocalFile:
    """One file of the part: its path in the checkpoint, where it is, as listed."""

    path: str
    local: Path
    size: int
    mtime_ns: int


@dataclass
class FileState:
    spans: list[tuple[int, int]]
    crcs: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, list[bytes]] = field(default_factory=dict)
    identity: Identity | None = None


def open_as_listed(local: LocalFile) -> tuple[int, os.stat_result]:
    """``local`` opened for reading, and its stat; PeerError when it is not as listed."""
    try:
        # Followed like the store upload follows it: a symlink to a file is that file.
        fd = os.open(local.local, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise PeerError(f"{local.path} cannot be read: {exc}", "changed") from exc
    st = os.fstat(fd)
    if st.st_size != local.size or st.st_mtime_ns != local.mtime_ns:
        os.close(fd)
        raise PeerError(f"{local.path} changed since it was listed", "changed")
    return fd, st


def _blocks(view: memoryview, digests: bool) -> list[bytes]:
    if not digests:
        return []
    return [
        digest.block_digest(view[i : i + digest.BLOCK]) for i in range(0, len(view), digest.BLOCK)
    ]


def read_chunk(
    local: LocalFile, offset: int, length: int, digests: bool
) -> tuple[bytes, int, list[bytes], Identity]:
    """One chunk of ``local``, its CRC-32C and block digests, and the file's identity;
    PeerError when the file is no longer the one listed."""
    fd, st = open_as_listed(local)
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(data) != length:
        raise PeerError(f"{local.path} is shorter than listed", "changed")
    return data, checksum.crc32c(data), _blocks(memoryview(data), digests), identity_of(st)


def read_chunk_into(
    fd: int, local: LocalFile, offset: int, buffer: memoryview, digests: bool
) -> tuple[int, list[bytes]]:
    """``read_chunk`` from ``fd`` (``open_as_listed``) into ``buffer`` (all of it: the
    chunk's length), reused by the caller: its CRC-32C and block digests."""
    got = 0
    while got < len(buffer):
        n = os.preadv(fd, [buffer[got:]], offset + got)
        if n == 0:
            raise PeerError(f"{local.path} is shorter than listed", "changed")
        got += n
    return checksum.crc32c(buffer), _blocks(buffer, digests)


def chunk_refusal(
    address: str, local: LocalFile, offset: int, status: int, doc: Any, damaged: int
) -> PeerError | None:
    """The error that ends the push for this answer to a chunk (``status`` 0: no answer,
    the connection dropped), or None: send it again. ``damaged``: 422s so far, this one
    included."""
    if status == 404:
        return PeerRestartedError(f"{address} no longer knows the transfer")
    if status == 503 and reason_of(status, doc) == "notice":
        return PeerError(f"{address} has a notice: {said(doc, status)}", "notice")
    if status == 422:
        if damaged >= DAMAGED_SENDS:
            return PeerError(
                f"{address}: {local.path} at {offset} arrived damaged {damaged} times", "corrupt"
            )
        return None
    if status and status < 500:
        return PeerError(f"{address} refused a chunk: {said(doc, status)}", reason_of(status, doc))
    return None


def reason_of(status: int, doc: Any) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("reason"), str):
        return str(doc["reason"])
    return {401: "unauthorized", 404: "unknown", 507: "quota"}.get(status, "failed")


def said(doc: Any, status: int) -> str:
    if isinstance(doc, dict) and doc.get("error"):
        return f"{status} {doc['error']}"
    return str(status)


__all__ = [
    "DAMAGED_SENDS",
    "FileState",
    "LocalFile",
    "PeerAbandonedError",
    "PeerError",
    "PeerRestartedError",
    "chunk_refusal",
    "open_as_listed",
    "read_chunk",
    "read_chunk_into",
    "reason_of",
    "said",
]
