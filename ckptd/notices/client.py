"""What the HTTP notice sources (AWS, GCP, Azure) share: the error for a response that
breaks the documented protocol, how a failure is described in a log line, and the
session a poll runs in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp


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
