"""What the HTTP notice sources (AWS, GCP, Azure) share: their common state, the error
for a response that breaks the documented protocol, how a failure is described in a log
line, and the session a poll runs in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from ckptd.notices.health import SourceHealth
from ckptd.notices.model import Clock, RateLimitedLog, Sleep


class MetadataSource:
    """The state every cloud metadata source keeps: its endpoint, the caller's session
    (None: one of its own per poll), time as injected by the tests (wall clock, sleep,
    monotonic), warnings rate-limited to one per ``log_interval`` per failure, and its
    ``health`` (``ckptd.notices.health``), told of every failure and success."""

    name: str  # "aws", "gcp", "azure": the ``source`` of its log lines

    def __init__(
        self,
        endpoint: str,
        *,
        session: aiohttp.ClientSession | None,
        clock: Clock,
        sleep: Sleep,
        monotonic: Callable[[], float],
        log: Any,
        log_interval: float,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._session = session
        self._clock = clock
        self._sleep = sleep
        self._monotonic = monotonic
        self._log = log
        self.health = SourceHealth(self.name)
        self._warn = RateLimitedLog(log, log_interval, monotonic, self.health)


class BadResponse(Exception):
    """A response that is not what the documented protocol returns."""


def describe_error(exc: BaseException) -> str:
    """A short, log-friendly description of a failed metadata request."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, BadResponse):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@asynccontextmanager
async def session_scope(
    session: aiohttp.ClientSession | None,
) -> AsyncIterator[aiohttp.ClientSession]:
    """The caller's session if it gave one, else a fresh one closed afterwards."""
    if session is not None:
        yield session
        return
    # trust_env=False (the default): a metadata request must never go via a proxy.
    async with aiohttp.ClientSession() as fresh:
        yield fresh
