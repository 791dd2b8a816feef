"""A Unix socket's path as ``bind``/``connect`` can take it, however long.

``sockaddr_un`` holds 107 bytes of path; a state dir deep in a job's scratch space or a
pod's volume is longer than that with ``/ckptd.sock`` on it. Such a path is reached
through ``/proc/self/fd/N/NAME``, N a descriptor of its directory held open for the call
(Linux resolves the link as that very directory, so the socket is created, or found,
where the long path names it). A short path is used as it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

#: The longest path ``sockaddr_un`` holds (108 bytes, one for the NUL).
SUN_PATH_MAX = 107


@contextlib.contextmanager
def socket_address(path: Path) -> Iterator[str]:
    """The address to ``bind`` or ``connect`` for ``path``, valid inside the ``with``."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
