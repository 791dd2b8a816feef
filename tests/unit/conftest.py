"""The fast set stays pure: a unit test that starts a process, opens a network
connection, binds a network port or sleeps fails here, naming what it did.

Pure means data in, data out (files under ``tmp_path`` are allowed, a store is not):
what needs more belongs in tests/integration. The guard is cheap on purpose, a few
attributes swapped per test, so the whole set stays well under 30 s.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from typing import Any, NoReturn

import pytest

# Address families of a network (AF_UNIX socketpairs are how an event loop wakes itself).
_NETWORK = {socket.AF_INET, socket.AF_INET6}


def _refuse(what: str) -> NoReturn:
    raise AssertionError(
        f"a unit test must be pure, but this one {what}: move it to tests/integration"
    )


@pytest.fixture(autouse=True)
def pure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test in tests/unit runs with processes, network sockets and sleeps refused."""

    def no_process(*_: Any, **__: Any) -> NoReturn:
        _refuse("starts a subprocess")

    def no_connect(self: socket.socket, *_: Any, **__: Any) -> NoReturn:
        _refuse("opens a network connection")

    real_bind = socket.socket.bind

    def bind_unless_network(self: socket.socket, address: Any) -> None:
        if self.family in _NETWORK:
            _refuse("binds a network port (a server)")
        real_bind(self, address)

    def no_sleep(seconds: float) -> NoReturn:
        _refuse(f"sleeps ({seconds} s); pass a clock in instead")

    real_async_sleep = asyncio.sleep

    async def yield_only(delay: float, result: Any = None) -> Any:
        # sleep(0) only hands the loop a turn; a real delay is waiting on time.
        if delay > 0:
            _refuse(f"sleeps ({delay} s in asyncio); pass a clock in instead")
        return await real_async_sleep(0, result)

    # _execute_child is where Popen forks: run(), check_output() and asyncio's
    # subprocesses all pass through it, and Popen's own bookkeeping is already set.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", no_process)
    for name in ("fork", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, no_process)
    monkeypatch.setattr(socket.socket, "connect", no_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", no_connect)
    monkeypatch.setattr(socket.socket, "bind", bind_unless_network)
    monkeypatch.setattr(time, "sleep", no_sleep)
    monkeypatch.setattr(asyncio, "sleep", yield_only)
