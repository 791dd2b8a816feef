"""The cryptographic digest of a file that an authenticated manifest carries.

A file's digest is BLAKE3 over its size and the BLAKE3 of each 1 MiB block, in order
(a one-level hash list). Blocks let every party hash in the pieces it already handles,
in any order and in parallel: an upload's parts and a restore's ranged GETs (both start
at multiples of 1 MiB) each yield their own blocks' digests, which fold into the file's
without a byte being read twice or held whole. BLAKE3 rather than SHA-256 for speed
(bench/bench_digest.py; docs/security.md, docs/benchmarks.md).

Pure: hashing only, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from blake3 import blake3

ALGORITHM = "blake3-1mib-list"
BLOCK = 1024 * 1024
_DOMAIN = b"ckptd.digest/1\n"


def block_digest(data: bytes | bytearray | memoryview) -> bytes:
    """The digest of one block (at most BLOCK bytes); the GIL is released while hashing."""
    return blake3(data).digest()


def file_digest(size: int, blocks: Iterable[bytes]) -> str:
    """The file's digest (hex) from its size and its blocks' digests, in order."""
    top = blake3(_DOMAIN)
    top.update(size.to_bytes(8, "big"))
    for b in blocks:
        top.update(b)
    return top.hexdigest()


def digest_of_bytes(data: bytes | bytearray | memoryview) -> str:
    """The digest of a whole file held in memory."""
    view = memoryview(data)
    return file_digest(
        len(view), (block_digest(view[i : i + BLOCK]) for i in range(0, len(view), BLOCK))
    )


class RangeDigest:
    """Block digests of one range that starts at a multiple of BLOCK, from the pieces
    ``Storage.stream_range`` (or a file read) hands over in order; a retried GET starts
    again from ``pos == 0``, and so does the value."""

    def __init__(self) -> None:
        self.blocks: list[bytes] = []
        self._open = blake3()
        self._filled = 0

    def update(self, pos: int, piece: bytes | bytearray | memoryview) -> None:
        if pos == 0:
            self.blocks, self._open, self._filled = [], blake3(), 0
        view = memoryview(piece)
        while len(view):
            take = min(BLOCK - self._filled, len(view))
            if take == BLOCK:  # a whole aligned block: hash it in one call
                self.blocks.append(block_digest(view[:take]))
            else:
                self._open.update(view[:take])
                self._filled += take
                if self._filled == BLOCK:
                    self.blocks.append(self._open.digest())
                    self._open, self._filled = blake3(), 0
            view = view[take:]

    def finish(self) -> list[bytes]:
        """The range's block digests, the last (short) block included."""
        if self._filled:
            self.blocks.append(self._open.digest())
            self._open, self._filled = blake3(), 0
        return self.blocks


def aligned_chunk(chunk_bytes: int) -> int:
    """``chunk_bytes`` rounded up to a whole number of blocks, so ranges start on one."""
    return max(BLOCK, -(-chunk_bytes // BLOCK) * BLOCK)
