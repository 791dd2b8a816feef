"""Start the kernel writing a file's dirty pages now, so the fsync that follows has less
to wait for.

Without this, pages written during a restore sit dirty until the final ``fsync`` (Linux
starts background writeback only past ``dirty_background_ratio`` of memory, gigabytes on
a GPU node), so the disk idles while bytes arrive and then the whole checkpoint is
written while the caller waits. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` queues a
range for writeback and returns at once (PostgreSQL's ``pg_flush_data`` does the same).
It is advice: it promises no durability, the ``fsync`` still does that, and it is skipped
where the call does not exist. Python's ``os`` has no binding, hence ``ctypes``.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>


def _load() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def available() -> bool:
    """Whether writeback can be started early on this system."""
    return _sync_file_range is not None


def start(fd: int, offset: int, length: int) -> None:
    """Queue ``length`` bytes of ``fd`` from ``offset`` for writeback; never blocks on it.
    A failure is ignored here: the caller's ``fsync`` reports any write error."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)
