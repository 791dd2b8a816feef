"""What a restoring node serves the others of its shared restore: its state and its files.

A small threaded HTTP server of its own (the restore may run with no daemon on the node:
``ckptd restore`` in a pod's init step), on the peer port's host and a port the kernel
picks (the record in the store names it). Two routes, each signed with the cluster's
token exactly as the peer port's are (``ckptd.peers.auth``; 401 otherwise, nothing read)::

    GET /v1/share/<session>/state?after=V&from=A   the board's document and the
        participants this node knows, held until its version passes V (1 s at most);
        A, the poller's address, is met (``ShareSession.met``)
    GET /v1/share/<session>/files/<n>   file n of the manifest (Range: bytes=A-B)

A file is served only once this node verified it, from where it is then (the staging
dir, or the checkpoint once renamed into place), opened without following a link at
any level, read-only, and only while it is the same inode of the same size as when it
verified (``Served``); else 409, and the reader takes it from elsewhere. Bytes go out
with ``sendfile``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from ckptd.peers import auth

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")


@dataclass
class Served:
    """The files this node verified, and where they may be: each as its path components
    under the staging dir's ``data`` and under the checkpoint once in place."""

    staged: Path  # DIR/.ckptd-restore-NAME/data (a file, for a one-file checkpoint)
    final: Path  # DIR/NAME
    _files: dict[int, tuple[tuple[str, ...], int, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, number: int, parts: tuple[str, ...], inode: int, size: int) -> None:
        with self._lock:
            self._files[number] = (parts, inode, size)

    def open(self, number: int) -> tuple[int, int] | None:
        """``(fd, size)`` of file ``number`` while it is what verified here, else None."""
        with self._lock:
            found = self._files.get(number)
        if found is None:
            return None
        parts, inode, size = found
        for base in (self.staged, self.final):
            fd = open_beneath(base, parts)
            if fd is None:
                continue
            st = os.fstat(fd)
            if st.st_ino == inode and st.st_size == size:
                return fd, size
            os.close(fd)
        return None


def open_beneath(base: Path, parts: tuple[str, ...]) -> int | None:
    """``base/parts...`` opened read-only with no link followed at any level, or None."""
    try:
        if not parts:
            return os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fd = os.open(base, _DIR_FLAGS)
    except OSError:
        return None
    try:
        for name in parts[:-1]:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)


class ShareServer(ThreadingHTTPServer):
    """Serves one session (module doc); ``start`` runs it in a daemon thread."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        host: str,
        session: str,
        token: bytes,
        state: Callable[[int, str], dict[str, Any]],
        served: Served,
        on_served: Callable[[int], None],
        port: int = 0,
    ) -> None:
        self.session = session
        self.checker = auth.RequestChecker(token, lock=threading.Lock())
        self.state = state
        self.served = served
        self.on_served = on_served
        self.address_family = _family(host)
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A participant that went away mid-request (reset, timed out) is no error of this
        node's, and never a traceback on the restore's stderr: it is said by the reader."""

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="ckptd-share", daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60.0  # an idle keep-alive connection holds a thread no longer
    server: ShareServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the restore logs what matters; no line per request on stderr

    def do_GET(self) -> None:
        server = self.server
        why, _ = server.checker.check(
            self.headers.get("Authorization"), "GET", self.path, time.time()
        )
        if why is not None:
            self._answer(401, f"refused: {why}".encode())
            return
        prefix = f"/v1/share/{server.session}/"
        if not self.path.startswith(prefix):
            self._answer(404, b"no such session here")
            return
        rest, _, query = self.path[len(prefix) :].partition("?")
        if rest == "state":
            fields = dict(parse_qsl(query))
            after = fields.get("after", "-1")
            version = int(after) if after.lstrip("-").isdigit() else -1
            doc = server.state(version, fields.get("from", ""))
            self._answer(200, json.dumps(doc).encode(), "application/json")
        elif rest.startswith("files/") and rest[6:].isdigit():
            self._file(int(rest[6:]))
        else:
            self._answer(404, b"no such route")

    def _answer(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _file(self, number: int) -> None:
        opened = self.server.served.open(number)
        if opened is None:
            self._answer(409, b"not verified here (or changed since)")
            return
        fd, size = opened
        with os.fdopen(fd, "rb") as f:
            start, end = 0, size - 1
            wanted = self.headers.get("Range")
            if wanted is not None:
                m = _RANGE.match(wanted)
                if m is None or int(m.group(1)) > int(m.group(2)) or int(m.group(2)) >= size:
                    self._answer(416, f"{wanted!r} is not within {size} bytes".encode())
                    return
                start, end = int(m.group(1)), int(m.group(2))
            count = end - start + 1 if size else 0
            self.send_response(206 if wanted else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(count))
            self.end_headers()
            self.wfile.flush()
            if count:
                self.connection.sendfile(f, start, count)
            self.server.on_served(count)


__all__ = ["Served", "ShareServer", "open_beneath"]
