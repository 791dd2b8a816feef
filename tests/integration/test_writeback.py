"""Early writeback: ``ckptd.runtime.writeback.start`` gets a file's dirty pages to disk long
before the kernel's own flusher would (``dirty_expire_centisecs``, 30 s by default), so
the fsync that ends a restore waits for little."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import pytest

from ckptd.runtime import writeback

MiB = 1024 * 1024


def _dirty_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1])
    raise AssertionError("no Dirty line in /proc/meminfo")


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _file_dirty_kib(fd: int) -> int | None:
    """This file's own dirty pages, KiB (``cachestat(2)``, Linux 6.5: syscall 451 on every
    architecture), or None where the kernel has no such call."""
    stat = _CacheStat()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(451, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0) != 0:
        return None
    return int(stat.nr_dirty) * os.sysconf("SC_PAGE_SIZE") // 1024


def _write_dirty(path: Path, size: int) -> int:
    """``path`` written with ``size`` bytes and left dirty in the page cache; its fd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    block = os.urandom(MiB)
    for i in range(size // MiB):
        os.pwrite(fd, block, i * MiB)
    return fd


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_started_writeback_cleans_the_pages_well_before_the_kernel_would(tmp_path: Path) -> None:
    expire_s = int(Path("/proc/sys/vm/dirty_expire_centisecs").read_text()) / 100
    if expire_s < 10:
        pytest.skip(f"the kernel itself writes dirty pages back after {expire_s} s")
    assert writeback.available()
    size = 128 * MiB
    # While other writers hold the machine's dirty pages over its background threshold
    # (the suite's own campaigns, in CI), the kernel's flusher is already cleaning this
    # file too and the claim cannot be told apart: write it again after a pause, a few
    # times, before giving up on measuring it.
    for attempt in range(5):
        fd = _write_dirty(tmp_path / "restored.bin", size)
        # This file's own dirty pages where the kernel counts them (cachestat), else the
        # machine-wide counter, which other writers on a busy machine move too.
        own = _file_dirty_kib(fd) is not None

        def dirty(fd: int = fd, own: bool = own) -> int:
            return (_file_dirty_kib(fd) or 0) if own else _dirty_kib()

        dirty_before = dirty()
        if dirty_before >= size // 1024 * 3 // 4:
            break
        os.close(fd)
        time.sleep(1.0 * (attempt + 1))
    else:
        pytest.skip("the kernel's flusher was already cleaning the file (other writers)")
    try:
        writeback.start(fd, 0, size)
        started = time.monotonic()
        # Wait until at least half of this file's pages are clean.
        deadline = started + min(10.0, expire_s / 2)
        while dirty() > dirty_before - size // 1024 // 2:
            assert time.monotonic() < deadline, (
                f"Dirty still {dirty()} KiB (was {dirty_before}) after "
                f"{time.monotonic() - started:.1f} s; the kernel alone waits {expire_s} s"
            )
            time.sleep(0.05)
    finally:
        os.close(fd)


def test_start_is_harmless_on_a_bad_descriptor_or_an_empty_range() -> None:
    writeback.start(-1, 0, MiB)  # the fsync that follows is what reports errors
    writeback.start(0, 0, 0)
