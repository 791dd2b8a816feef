"""Helpers for the operations tests: a systemd notify socket, tool lookup, a daemon
that ships HF checkpoints to the session's SeaweedFS."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SYSTEMD = REPO / "systemd"


def tool(name: str) -> str | None:
    """An executable on PATH or beside this interpreter (the venv's bin/)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else None


class NotifySocket:
    """A real ``AF_UNIX`` datagram socket standing in for systemd's ``$NOTIFY_SOCKET``.

    ``abstract=True`` binds in the abstract namespace (``@name``); otherwise a short path
    under /tmp (socket paths are limited to 107 bytes, pytest's tmp_path can be longer).
    """

    def __init__(self, *, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._dir: str | None = None
        if abstract:
            name = f"ckptd-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + name)
            self.env_value = "@" + name
        else:
            self._dir = tempfile.mkdtemp(prefix="ckptd-sd-", dir="/tmp")
            path = os.path.join(self._dir, "notify")
            self.sock.bind(path)
            self.env_value = path
        self.sock.setblocking(False)
        self.messages: list[dict[str, str]] = []

    def drain(self) -> list[dict[str, str]]:
        """Read every datagram waiting; each becomes a dict of its KEY=VALUE lines."""
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return self.messages
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            fields["_at"] = f"{time.monotonic():.6f}"
            self.messages.append(fields)

    def with_field(self, key: str, value: str | None = None) -> list[dict[str, str]]:
        return [m for m in self.drain() if key in m and (value is None or m[key] == value)]

    def close(self) -> None:
        self.sock.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> NotifySocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hf_daemon(
    tmp_path: Path,
    local_s3: LocalS3,
    dest: str,
    *,
    name: str = "daemon",
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    **config: Any,
) -> tuple[Daemon, Path]:
    """A configured (not started) daemon watching ``tmp_path/<name>-run`` for HF checkpoints."""
    root = tmp_path / f"{name}-run"
    root.mkdir(exist_ok=True)
    daemon = Daemon.configured(
        tmp_path,
        name=name,
        watch=[{"dir": root, "run_id": "run1", "settle_seconds": 0.2}],
        dest=dest,
        endpoint_url=config.pop("endpoint_url", local_s3.endpoint_url),
        state_dir=tmp_path / f"{name}-state",
        **config,
    )
    daemon.env = dict(env or {})
    daemon.extra_args = list(extra_args or [])
    return daemon, root


@contextlib.contextmanager
def started(daemon: Daemon) -> Iterator[Daemon]:
    """Start ``daemon``; kill it on the way out if a test left it running."""
    with daemon:
        yield daemon


__all__ = ["DEPLOY", "REPO", "SYSTEMD", "NotifySocket", "hf_daemon", "started", "tool"]
