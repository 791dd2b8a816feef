"""systemd's notify protocol (``sd_notify(3)``), standard library only.

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET``; the daemon sends newline-separated
``KEY=VALUE`` datagrams to it: ``READY=1`` once it serves, ``STATUS=...`` for
``systemctl status``, ``WATCHDOG=1`` at least every ``$WATCHDOG_USEC / 2`` while healthy,
``STOPPING=1`` when shutdown begins. Without ``$NOTIFY_SOCKET`` every call is a no-op, and
a failed send never raises: reporting to systemd must not take the daemon down.

The watchdog is pinged from the service's ticker, not from a thread of its own, so a
stalled event loop stops the pings and systemd restarts the daemon.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any


def socket_address(value: str) -> str | None:
    """The ``AF_UNIX`` address named by ``$NOTIFY_SOCKET``: a path, or ``@name`` for the
    abstract namespace. ``None`` when unset or of a kind not spoken here (``vsock:``)."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_seconds(env: Mapping[str, str], pid: int) -> float | None:
    """The watchdog timeout systemd asks for, in seconds, or ``None`` when it asks for none
    (``$WATCHDOG_USEC`` unset or bad, or ``$WATCHDOG_PID`` names another process)."""
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(pid):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1_000_000 if usec > 0 else None


class SystemdNotifier:
    """Sends notify messages to systemd; inert when the daemon was not started by it."""

    def __init__(
        self,
        address: str | None,
        watchdog_timeout: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.watchdog_timeout = watchdog_timeout
        self._clock = clock
        self._last_ping: float | None = None
        self._last_status = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SystemdNotifier:
        """A notifier for ``$NOTIFY_SOCKET`` / ``$WATCHDOG_USEC`` (``os.environ`` by default)."""
        env = os.environ if env is None else env
        address = socket_address(env.get("NOTIFY_SOCKET", ""))
        return cls(address, watchdog_seconds(env, os.getpid()) if address else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def ping_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings: half the timeout, as sd_watchdog_enabled(3)
        recommends; ``None`` when systemd watches nothing."""
        return None if self.watchdog_timeout is None else self.watchdog_timeout / 2

    def notify(self, *fields: str) -> bool:
        """Send ``fields`` (``"READY=1"``, ...) as one datagram; True if it was sent."""
        if self.address is None or not fields:
            return False
        message = "\n".join(fields).encode("utf-8", "replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # MSG_DONTWAIT: a full receive queue must never block the event loop.
                sock.sendto(message, socket.MSG_DONTWAIT, self.address)
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        """``READY=1`` (and ``STATUS=``), once the daemon serves; starts the watchdog clock."""
        fields = ["READY=1"]
        if status:
            fields.append(f"STATUS={_one_line(status)}")
            self._last_status = status
        if self.ping_interval is not None:
            fields.append("WATCHDOG=1")
            self._last_ping = self._clock()
        return self.notify(*fields)

    def status(self, text: str) -> bool:
        """``STATUS=text``, sent only when it changed."""
        if text == self._last_status:
            return False
        self._last_status = text
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1`` now."""
        self._last_ping = self._clock()
        return self.notify("WATCHDOG=1")

    def tick(self, status: str | None = None) -> None:
        """Called on every service tick: ping the watchdog when half its timeout has passed
        since the last ping (tick granularity adds at most one tick), update ``STATUS``."""
        interval = self.ping_interval
        if self.enabled and interval is not None:
            now = self._clock()
            if self._last_ping is None or now - self._last_ping >= interval:
                self.watchdog()
        if status is not None and self.enabled:
            self.status(status)

    def stopping(self, status: str = "") -> bool:
        """``STOPPING=1``: shutdown has begun (flush on SIGTERM, then exit)."""
        fields = ["STOPPING=1"]
        if status:
            fields.append(f"STATUS={_one_line(status)}")
            self._last_status = status
        return self.notify(*fields)


def summarize(status: Mapping[str, Any]) -> str:
    """A one-line ``STATUS=`` from a ``/v1/status`` document, for ``systemctl status``."""
    runs: Mapping[str, Any] = status.get("runs") or {}
    pending = sum(len(r.get("pending") or []) for r in runs.values())
    uploading = [r["uploading"]["checkpoint"] for r in runs.values() if r.get("uploading")]
    parts = [f"{len(runs)} run{'s' if len(runs) != 1 else ''}", f"{pending} pending"]
    if uploading:
        parts.append("uploading " + ", ".join(uploading))
    lag = max((float(r.get("sync_lag_seconds") or 0) for r in runs.values()), default=0.0)
    if lag:
        parts.append(f"lag {lag:.0f}s")
    destination = status.get("destination") or {}
    if destination and not destination.get("ok", True):
        parts.append("DESTINATION DOWN")
    preemption = status.get("preemption") or {}
    if preemption.get("notice"):
        parts.append(f"NOTICE {preemption.get('source', '?')}/{preemption.get('kind', '?')}")
    return "; ".join(parts)


def _one_line(text: str) -> str:
    return " ".join(text.split())


__all__ = ["SystemdNotifier", "socket_address", "summarize", "watchdog_seconds"]
