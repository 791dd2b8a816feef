"""Early writeback: ``ckptd.runtime.writeback.start`` gets a file's dirty pages to disk long
before the kernel's own flusher would (``dirty_expire_centisecs``, 30 s by default), so
the fsync that ends a restore waits for little."""

from __future__ import annotations

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_started_writeback_cleans_the_pages_well_before_the_kernel_would(tmp_path: Path) -> None:
    expire_s = int(Path("/proc/sys/vm/dirty_expire_centisecs").read_text()) / 100
    if expire_s < 10:
        pytest.skip(f"the kernel itself writes dirty pages back after {expire_s} s")
    assert writeback.available()
    size = 128 * MiB
    fd = os.open(tmp_path / "restored.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        block = os.urandom(MiB)
        for i in range(size // MiB):
            os.pwrite(fd, block, i * MiB)
        dirty_before = _dirty_kib()
        assert dirty_before >= size // 1024 // 2, "the writes did not leave dirty pages"

        writeback.start(fd, 0, size)
        started = time.monotonic()
        # Machine-wide counter: wait until at least half of this file's pages are clean.
        deadline = started + min(10.0, expire_s / 2)
        while _dirty_kib() > dirty_before - size // 1024 // 2:
            assert time.monotonic() < deadline, (
                f"Dirty still {_dirty_kib()} KiB (was {dirty_before}) after "
                f"{time.monotonic() - started:.1f} s; the kernel alone waits {expire_s} s"
            )
            time.sleep(0.05)
    finally:
        os.close(fd)


def test_start_is_harmless_on_a_bad_descriptor_or_an_empty_range() -> None:
    writeback.start(-1, 0, MiB)  # the fsync that follows is what reports errors
    writeback.start(0, 0, 0)
