"""The HTTP surfaces (docs/design.md, "HTTP"; "Checkpoint cadence advice").

Two listeners, one ``HttpServer`` each:

- the scrape listener (``metrics.listen``): ``/metrics``, ``/healthz``, ``/readyz`` and
  ``/v1/preemption``, which read state any pod on the node may see (whether a notice is
  active and its deadline, which the cloud's metadata service tells it too). It serves
  the control API as well only when it is on loopback, or when a token is configured;
- the control listener (``http.listen``; by default the Unix socket
  ``<state.dir>/ckptd.sock``, mode 0600): everything, with ``/v1/status``,
  ``/v1/drill`` and ``/v1/advice``, which disclose the store and can stop training.

Invariant: a request that can stop training or read the store's status is answered only
on a listener only the node can reach (loopback, the socket), or with the bearer token,
compared in constant time. Elsewhere every path but the public ones answers 404 and
does nothing.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from ckptd.drill.runner import DrillBusyError
from ckptd.runtime.metrics import Metrics
from ckptd.runtime.socket_path import socket_address

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: What every listener serves to anyone: nothing here changes state or shows the store.
PUBLIC_PATHS = frozenset({"/metrics", "/healthz", "/readyz", "/v1/preemption"})
NOT_HERE = {
    "error": "not served on this listener: use `ckptd status` / `ckptd drill` on the node, "
    "or configure an [http] token (docs/security.md)"
}


class HttpServer:
    """Serves the daemon's state; the callables are read at request time.

    ``control`` False: the control API answers 404 (the scrape listener on a reachable
    address without a token). ``token`` set: the control API requires it."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        status: Callable[[], dict[str, Any]],
        ready: Callable[[], tuple[bool, dict[str, Any]]],
        preemption: Callable[[], dict[str, Any]],
        advice: Callable[[], dict[str, Any]] | None = None,
        drill: Callable[[float], Awaitable[dict[str, Any]]] | None = None,
        token: str = "",
        control: bool = True,
    ) -> None:
        self.metrics = metrics
        self._status = status
        self._ready = ready
        self._preemption = preemption
        self._drill = drill
        self._advice = advice
        self._token = token
        self.control = control
        self._runner: web.AppRunner | None = None
        self._socket: Path | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/preemption", self._v1_preemption)
        app.router.add_get("/v1/status", self._v1_status)
        app.router.add_get("/v1/advice", self._v1_advice)
        app.router.add_post("/v1/drill", self._v1_drill)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # Deny by default: any path not public is the control API's, present or future.
        if request.path not in PUBLIC_PATHS:
            if not self.control:
                return web.json_response(NOT_HERE, status=404)
            if self._token:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
                    return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _readyz(self, request: web.Request) -> web.Response:
        ok, detail = self._ready()
        return web.json_response({"ready": ok, **detail}, status=200 if ok else 503)

    async def _v1_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    async def _v1_preemption(self, request: web.Request) -> web.Response:
        return web.json_response(self._preemption())

    async def _v1_advice(self, request: web.Request) -> web.Response:
        if self._advice is None:
            return web.json_response({"runs": {}})
        return web.json_response(self._advice())

    async def _v1_drill(self, request: web.Request) -> web.Response:
        if self._drill is None:
            return web.json_response({"error": "drills are not available"}, status=404)
        try:
            deadline = float(request.query.get("deadline", "120"))
        except ValueError:
            return web.json_response({"error": "deadline must be seconds"}, status=400)
        if not 1 <= deadline <= 3600:
            return web.json_response({"error": "deadline must be 1..3600 seconds"}, status=400)
        try:
            return web.json_response(await self._drill(deadline))
        except DrillBusyError as exc:
            return web.json_response({"error": str(exc)}, status=409)

    async def start(self, host: str, port: int) -> int:
        """Listen on TCP; returns the bound port (useful with port 0)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else port
        return self.port

    async def start_unix(self, path: Path) -> None:
        """Listen on the Unix socket ``path`` (mode 0600), replacing a stale one."""
        if path.is_socket():
            path.unlink()  # left by a daemon that died (the instance lock says none runs)
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        with socket_address(path) as address:  # a long path too (ckptd.runtime.socket_path)
            await web.UnixSite(self._runner, address).start()
        self._socket = path
        # Connecting needs write permission on the socket: the daemon's user (and root).
        path.chmod(0o600)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.unlink()
            self._socket = None
