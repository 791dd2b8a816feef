"""A user's own local S3 as ``make s3`` gives it (``python -m ckptd.devtools.locals3``): the
process, and the exports it prints for the user to paste."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class OwnS3:
    process: subprocess.Popen[str]
    exports: dict[str, str]  # what it printed after "export "
    said_at_stop: str = ""  # its standard output after the exports, once stopped

    @property
    def endpoint_url(self) -> str:
        return self.exports["AWS_ENDPOINT_URL"]


def _read_until(process: subprocess.Popen[str], marker: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} within {timeout} s: {lines}")


@contextlib.contextmanager
def own_s3(data_dir: Path) -> Iterator[OwnS3]:
    """Start it, read its exports; at the end Ctrl-C it (SIGINT) and wait for it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ckptd.devtools.locals3", "--dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    handle = OwnS3(process, {})
    try:
        lines = _read_until(process, "Ctrl-C stops it.", timeout=120)
        handle.exports = dict(
            line.strip().removeprefix("export ").split("=", 1)
            for line in lines
            if line.strip().startswith("export ")
        )
        yield handle
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            handle.said_at_stop, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
