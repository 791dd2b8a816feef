"""The I/O edge of the health sources: the kernel log followed, small files read whole,
a filesystem's free space. Everything here runs in a worker thread (the monitor's
``asyncio.to_thread``) and never blocks: the kernel log is opened non-blocking.

Invariant: a reader never raises on what it reads; a source it cannot open is
``unreadable`` with the reason (``ckptd doctor`` and ``/v1/status`` say so) and is
tried again at the next poll.
"""

from __future__ import annotations

import contextlib
import errno
import os
import urllib.error
import urllib.request
from pathlib import Path

# /dev/kmsg answers one record per read, at most this long (CONSOLE_EXT_LOG_MAX).
READ_SIZE = 64 * 1024
# A DCGM exporter on the node answers in milliseconds; one that does not is not read.
HTTP_TIMEOUT_SECONDS = 2.0
# A /metrics page larger than this is not an exporter's (8 GPUs: ~100 KiB).
HTTP_MAX_BYTES = 4 << 20


class KmsgReader:
    """Follows a kernel log (``/dev/kmsg``, or a file or FIFO of its lines) from the end:
    only lines written after it opened are read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.unreadable: str | None = None
        self._partial = b""

    def open(self) -> bool:
        """Open it (again), at its end; False with ``unreadable`` set when it cannot be."""
        if self.fd is not None:
            return True
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            self.unreadable = f"cannot open {self.path}: {exc.strerror or exc}"
            return False
        with contextlib.suppress(OSError):  # a FIFO cannot seek; /dev/kmsg's end is "now"
            os.lseek(self.fd, 0, os.SEEK_END)
        self.unreadable = None
        return True

    def lines(self) -> list[str]:
        """Every whole line written since the last call."""
        if not self.open():
            return []
        assert self.fd is not None
        chunks = [self._partial]
        while True:
            try:
                chunk = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # /dev/kmsg: records overwritten; go on
                    continue
                self.unreadable = f"cannot read {self.path}: {exc.strerror or exc}"
                self.close()
                break
            if not chunk:
                break  # end of a file, or a FIFO with no writer
            chunks.append(chunk)
        data = b"".join(chunks)
        whole, _, self._partial = data.rpartition(b"\n")
        return [line.decode(errors="replace") for line in whole.split(b"\n")] if whole else []

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def read_small(path: Path) -> str | None:
    """The text of a small file (a PSI or cgroup file), None when it cannot be read."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def free_bytes(path: Path) -> int | None:
    """Bytes free to an unprivileged writer on ``path``'s filesystem, None if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def fetch_text(url: str) -> tuple[str | None, str]:
    """(the body of ``url``, "") or (None, why it could not be read)."""
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_SECONDS) as answer:
            body = answer.read(HTTP_MAX_BYTES + 1)
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, resets
        return None, f"cannot read {url}: {exc}"
    if len(body) > HTTP_MAX_BYTES:
        return None, f"{url} answered more than {HTTP_MAX_BYTES} bytes"
    return body.decode(errors="replace"), ""


def device_of(path: Path) -> tuple[int, int] | None:
    """(major, minor) of the device holding ``path``, None if it cannot be stat'ed."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    return os.major(dev), os.minor(dev)
