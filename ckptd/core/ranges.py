"""Ranged reads of one object: the spans a reader asks for, and the CRC-32C of each as it
arrives. Pure; ``ckptd.repository`` re-exports both (restore, verify and the repository's
own ``crc_of_object`` read objects in these ranges)."""

from __future__ import annotations

from ckptd.core import checksum


def chunk_ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each ranged GET of an object of ``size`` bytes."""
    return [(start, min(chunk, size - start)) for start in range(0, size, chunk)]


class RangeCrc:
    """The CRC-32C of one range as ``Storage.stream_range`` hands it over; a retried GET
    starts again from ``pos == 0``, and so does the value."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, pos: int, piece: bytes) -> None:
        self.value = checksum.crc32c(piece, self.value if pos else 0)


__all__ = ["RangeCrc", "chunk_ranges"]
