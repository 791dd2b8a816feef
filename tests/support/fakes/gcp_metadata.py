"""A fake Compute Engine metadata server on loopback.

Behaviour, as documented:

- Requests must carry ``Metadata-Flavor: Google`` and no ``X-Forwarded-For``; otherwise
  403 Forbidden. Responses carry ``Metadata-Flavor: Google`` and an ``ETag``.
  https://cloud.google.com/compute/docs/metadata/querying-metadata
  https://cloud.google.com/compute/docs/troubleshooting/troubleshoot-metadata-server
- ``?wait_for_change=true`` hangs until the value changes, or ``timeout_sec`` passes
  (then the current value is returned); with ``last_etag=E`` it returns at once if the
  current ETag differs from E. The ETag is a hash of the value, as on GCE.
  https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange
- ``/computeMetadata/v1/instance/preempted``: ``FALSE`` / ``TRUE``.
  https://cloud.google.com/compute/docs/instances/create-use-preemptible#detecting_if_an_instance_was_preempted
- ``/computeMetadata/v1/instance/maintenance-event``: ``NONE`` /
  ``MIGRATE_ON_HOST_MAINTENANCE`` / ``TERMINATE_ON_HOST_MAINTENANCE``; 503 for a while
  during maintenance.
  https://cloud.google.com/compute/docs/metadata/getting-live-migration-notice

Extra mode: ``impostor`` answers ``TRUE`` with 200 but without ``Metadata-Flavor`` (as a
proxy or captive portal might), which a client must not believe.
"""

from __future__ import annotations

import hashlib
import time

from aiohttp import web

from tests.support.fakes import FakeServer

FLAVOR = "Metadata-Flavor"
PREFIX = "/computeMetadata/v1/instance/"
MAX_WAIT = 3600


def etag_of(value: str) -> str:
    """A 16-hex-digit content hash, like GCE's ETags."""
    return hashlib.sha256(value.encode()).hexdigest()[:16]


class FakeGcpMetadata(FakeServer):
    """The instance/preempted and instance/maintenance-event keys, with hanging GETs."""

    MODES = FakeServer.MODES | {"impostor"}

    def __init__(self) -> None:
        super().__init__()
        self._values: dict[str, str] = {
            "preempted": "FALSE",
            "maintenance-event": "NONE",
            "name": "ckptd-test-vm",
            "id": "4520031799277581759",
        }

    # -- control API -------------------------------------------------------------------

    def preempt(self) -> None:
        """Set ``instance/preempted`` to ``TRUE``."""
        self.set_value("preempted", "TRUE")

    def set_maintenance(self, value: str) -> None:
        """Set ``instance/maintenance-event`` (``NONE``, ``MIGRATE_ON_HOST_MAINTENANCE``...)."""
        self.set_value("maintenance-event", value)

    def set_value(self, key: str, value: str) -> None:
        """Set any ``instance/<key>``; wakes hanging GETs on it."""
        with self._lock:
            self._values[key] = value
        self._changed()

    def value(self, key: str) -> str:
        """The current value of ``instance/<key>``."""
        with self._lock:
            return self._values[key]

    @property
    def requests_without_flavor(self) -> int:
        """Requests that came without ``Metadata-Flavor: Google``."""
        return sum(1 for r in self.requests if r.header(FLAVOR) != "Google")

    # -- HTTP --------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        app.router.add_get(PREFIX + "{key}", self._get)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get(FLAVOR) != "Google" or "X-Forwarded-For" in request.headers:
            return _reply(403, "Missing required header: Metadata-Flavor: Google")
        key = request.match_info["key"]
        with self._lock:
            if key not in self._values:
                return _reply(404, "Not Found")
        wait = request.query.get("wait_for_change", "").lower() == "true"
        if wait:
            try:
                timeout = min(int(request.query.get("timeout_sec", MAX_WAIT)), MAX_WAIT)
            except ValueError:
                return _reply(400, "Invalid timeout_sec")
            last_etag = request.query.get("last_etag")
            deadline = time.monotonic() + timeout
            while True:
                with self._lock:
                    version, mode = self._version, self._mode
                    current = etag_of(self._values[key])
                if mode != "ok" or (last_etag is not None and current != last_etag):
                    break
                if last_etag is None:
                    last_etag = current  # without last_etag: wait for a change from now
                left = deadline - time.monotonic()
                if left <= 0 or not await self.wait_for_change(version, left):
                    break
        mode = self.mode
        if mode == "hang":
            await self.hang()
            mode = self.mode
        if mode in ("500", "503"):
            return _reply(int(mode), "error")
        if mode == "impostor":
            return web.Response(status=200, text="TRUE", content_type="text/html")
        with self._lock:
            value = self._values[key]
        if mode == "garbage":
            value = "\ufffdMAYBE<html>"
        elif mode == "wrong-shape":
            value = '{"preempted": true}'
        return _reply(200, value, etag_of(value))


def _reply(status: int, body: str, etag: str | None = None) -> web.Response:
    headers = {FLAVOR: "Google"}
    if etag is not None:
        headers["ETag"] = etag
    return web.Response(status=status, text=body, content_type="application/text", headers=headers)
