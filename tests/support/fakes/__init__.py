"""Loopback fakes of the clouds' metadata services, and helpers for tests that use them.

Each fake is an aiohttp server on 127.0.0.1 that implements its service's protocol as
documented (paths, required headers, status codes, JSON shapes; the URL of each shape is
cited at the top of its module), with a small control API in Python (``trigger_spot``,
``preempt``, ``add_event``, ``set_mode``...) and a record of the requests it received.

A fake runs either on the test's own event loop::

    async with FakeAwsImds() as imds:          # or: url = await imds.start()
        source = AwsImdsSource(imds.url, poll_interval=0.05)

or in a background thread with its own loop, for tests that run the daemon as a
subprocess::

    imds = FakeAwsImds()
    url = imds.start_in_thread()
    ...
    imds.stop_thread()                         # or: with FakeAwsImds() as imds: ...

Control methods are thread-safe either way. Fault modes (``set_mode``) shared by all
fakes: ``ok``, ``500``, ``503``, ``garbage`` (200 with a body that is not the documented
format), ``wrong-shape`` (200 with well-formed JSON of the wrong shape), ``hang`` (the
response never comes while the mode lasts); each fake documents its own extras.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from aiohttp import web
from multidict import CIMultiDict

from ckptd.devtools.locals3 import free_port
from ckptd.notices.model import Notice, NoticeSource

__all__ = [
    "Collector",
    "FakeServer",
    "RecordedRequest",
    "free_port",
    "wait_until",
]


@dataclass
class RecordedRequest:
    """One request as the fake received it, and the status it answered (None: no answer)."""

    method: str
    path: str
    query: dict[str, str]
    headers: CIMultiDict[str]
    body: bytes
    at: float  # time.monotonic() on arrival
    status: int | None = None

    def header(self, name: str) -> str | None:
        """A request header (case-insensitive), or None."""
        return self.headers.get(name)


class FakeServer:
    """Base of the fakes: lifecycle (loop or thread), request log, fault mode."""

    #: Modes every fake understands; subclasses extend.
    MODES: frozenset[str] = frozenset({"ok", "500", "503", "garbage", "wrong-shape", "hang"})

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._requests: list[RecordedRequest] = []
        self._mode = "ok"
        self._version = 0  # bumped on every state change; hanging handlers watch it
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self.host = "127.0.0.1"
        self.port = 0

    # -- to be provided by subclasses ----------------------------------------------------

    def routes(self, app: web.Application) -> None:
        """Add the service's routes to ``app``."""
        raise NotImplementedError

    # -- state -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (the source's ``endpoint``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def mode(self) -> str:
        with self._lock:
            return self._mode

    def set_mode(self, mode: str) -> None:
        """Switch the fault mode (see the module docstring and the subclass)."""
        if mode not in self.MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {sorted(self.MODES)}")
        with self._lock:
            self._mode = mode
            self._version += 1

    def _changed(self) -> None:
        with self._lock:
            self._version += 1

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of the requests received so far, oldest first."""
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        """Forget the requests received so far."""
        with self._lock:
            self._requests.clear()

    def count(
        self,
        path: str | None = None,
        *,
        method: str | None = None,
        status: int | None = None,
        since: float | None = None,
    ) -> int:
        """How many recorded requests match (``path`` is a prefix; ``since`` a monotonic time)."""
        return sum(
            1
            for r in self.requests
            if (path is None or r.path.startswith(path))
            and (method is None or r.method == method)
            and (status is None or r.status == status)
            and (since is None or r.at >= since)
        )

    async def hang(self, limit: float = 120.0) -> None:
        """Wait while the mode is ``hang`` (bounded, so a forgotten fake cannot hang CI)."""
        deadline = time.monotonic() + limit
        while self.mode == "hang" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def wait_for_change(self, version: int, timeout: float) -> bool:
        """Wait until the state changes after ``version`` or ``timeout``; True if changed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._version != version:
                    return True
            await asyncio.sleep(0.01)
        return False

    # -- lifecycle on the caller's loop --------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port); returns the base URL."""
        app = web.Application(middlewares=[self._record])
        self.routes(app)
        # handler_cancellation: a handler is cancelled when its client goes away, so a
        # "hang" does not outlive the client; a short shutdown_timeout for fast teardown.
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.2
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self.host = host
        self.port = runner.addresses[0][1]  # the real port when port=0
        self._runner = runner
        return self.url

    async def stop(self) -> None:
        """Stop listening (the port is then closed: connections are refused)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- lifecycle in a background thread ------------------------------------------------

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve from a daemon thread with its own event loop; returns the base URL."""
        if self._thread is not None:
            raise RuntimeError("already running in a thread")
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start(host, port))
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.stop())
                loop.close()

        thread = threading.Thread(target=run, name=f"{type(self).__name__}", daemon=True)
        thread.start()
        if not started.wait(10):
            raise RuntimeError("fake did not start within 10 s")
        if failure:
            thread.join(5)
            raise failure[0]
        self._thread, self._thread_loop = thread, loop
        return self.url

    def stop_thread(self) -> None:
        """Stop the background thread started by :meth:`start_in_thread`."""
        thread, loop = self._thread, self._thread_loop
        self._thread = self._thread_loop = None
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    def __enter__(self) -> Self:
        self.start_in_thread()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_thread()

    # -- request log -------------------------------------------------------------------

    @web.middleware
    async def _record(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        record = RecordedRequest(
            method=request.method,
            path=request.path,
            query=dict(request.query),
            headers=CIMultiDict(request.headers),
            body=await request.read(),
            at=time.monotonic(),
        )
        with self._lock:
            self._requests.append(record)
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            record.status = exc.status
            raise
        record.status = response.status
        return response


async def wait_until(
    predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` every 10 ms until it holds; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Collector:
    """Runs ``source.watch()`` in a task and collects what it yields.

    Waiting on the queue (not on the generator) lets a test time out a wait without
    cancelling the watch, and then check the watch is still alive.
    """

    source: NoticeSource
    received: list[tuple[float, Notice]] = field(default_factory=list)
    _queue: asyncio.Queue[Notice] = field(default_factory=asyncio.Queue)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run(), name=f"collect-{self.source.name}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Cancel the watch and wait for it to finish (its cleanup runs)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        async for notice in self.source.watch():
            self.received.append((time.monotonic(), notice))
            await self._queue.put(notice)

    async def next(self, timeout: float = 5.0) -> Notice:
        """The next notice; AssertionError if none comes within ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            self.assert_alive()
            raise AssertionError(f"no notice within {timeout} s") from None

    async def expect_nothing(self, within: float) -> None:
        """Assert that no notice arrives for ``within`` seconds (a bounded wait by design)."""
        try:
            notice = await asyncio.wait_for(self._queue.get(), within)
        except TimeoutError:
            self.assert_alive()
            return
        raise AssertionError(f"unexpected notice: {notice}")

    def assert_alive(self) -> None:
        """The watch task is still running (it has neither returned nor raised)."""
        assert self._task is not None, "collector not started"
        if self._task.done():
            exc = None if self._task.cancelled() else self._task.exception()
            raise AssertionError(f"watch ended: {exc!r}")

    def pending(self) -> int:
        """Notices received but not yet taken with :meth:`next`."""
        return self._queue.qsize()


@contextlib.asynccontextmanager
async def running(fake: FakeServer, port: int = 0) -> AsyncIterator[FakeServer]:
    """``async with running(fake, port)``: start on a given port, stop at the end."""
    await fake.start(port=port)
    try:
        yield fake
    finally:
        await fake.stop()
