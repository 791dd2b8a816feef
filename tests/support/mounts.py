"""Real mounts for fault tests: a small tmpfs (a disk that fills), and a bind mount of a
directory onto itself that can be remounted read-only and back (a mount that turns
read-only). Mounting needs root; ``mount_or_skip`` skips a test where it cannot.

A mount turns read-only only while no file on it is open for writing (the kernel says
EBUSY): ``set_read_only`` tries again within its deadline.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


def _skip_unless_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")


@contextlib.contextmanager
def tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` at ``path`` (made), unmounted at the end."""
    _skip_unless_root()
    path.mkdir(parents=True, exist_ok=True)
    done = _mount("-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def bind_mount(path: Path) -> Iterator[Path]:
    """``path`` (made) bind-mounted onto itself, so that it alone can turn read-only."""
    _skip_unless_root()
    path.mkdir(parents=True, exist_ok=True)
    done = _mount("--bind", str(path), str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def set_read_only(path: Path, read_only: bool, timeout: float = 10.0) -> None:
    """Remount the bind mount at ``path`` read-only (or back), retrying while busy."""
    flags = "remount,bind," + ("ro" if read_only else "rw")
    deadline = time.monotonic() + timeout
    while True:
        done = _mount("-o", flags, str(path))
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"mount -o {flags} {path}: {done.stderr.strip()}")
        time.sleep(0.05)


def fill(path: Path) -> Path:
    """Fill the filesystem under ``path`` to the last byte; returns the filler file."""
    filler = path / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    return filler
