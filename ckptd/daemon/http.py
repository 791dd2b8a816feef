"""The HTTP surface: ``/metrics``, ``/healthz``, ``/readyz``, ``/v1/status``,
``/v1/preemption``, ``/v1/advice`` (docs/design.md, "HTTP"; "Checkpoint cadence advice"). Loopback by default; an optional bearer token
guards ``/v1/*``."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ckptd.runtime.metrics import Metrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpServer:
    """Serves the daemon's state; the callables are read at request time."""

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
    ) -> None:
        self.metrics = metrics
        self._status = status
        self._ready = ready
        self._preemption = preemption
        self._drill = drill
        self._advice = advice
        self._token = token
        self._runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/v1/status", self._v1_status)
        app.router.add_get("/v1/preemption", self._v1_preemption)
        app.router.add_get("/v1/advice", self._v1_advice)
        app.router.add_post("/v1/drill", self._v1_drill)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._token and request.path.startswith("/v1/"):
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
        return web.json_response(await self._drill(deadline))

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
