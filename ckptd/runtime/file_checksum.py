"""The CRC-32C of a file on this machine, read in ``READ_BYTES`` pieces and folded as it
is read (``ckptd.core.checksum``, C via awscrt): the one reader the local check, the
set-aside of a part under a restore's name, and the drill's proof share.

Invariant: the file is only read, never written; ``from_disk`` reads what the disk
holds, not the page cache, and never follows a link in the last component."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ckptd.core import checksum

READ_BYTES = 4 * 1024 * 1024


def file_crc32c(path: str | Path, *, from_disk: bool = False) -> int:
    """The CRC-32C of the file at ``path``. ``from_disk``: its clean cached pages are
    dropped first, so the read comes from the disk (a file a restore fsynced), and a
    link at ``path`` is refused (``OSError``)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if from_disk else 0)
    fd = os.open(path, flags)
    try:
        if from_disk:
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        crc = 0
        while piece := os.read(fd, READ_BYTES):
            crc = checksum.crc32c(piece, crc)
        return crc
    finally:
        os.close(fd)
