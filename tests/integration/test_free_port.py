"""``free_port`` with ``TEST_PORT_RANGE``: make test gives its two pytest processes
disjoint ranges, so one cannot hand out a port the other just found free."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ckptd.devtools.locals3 import PORT_RANGE_ENV, free_port


def test_ports_come_from_the_range_and_are_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-21099")
    ports = {free_port() for _ in range(50)}
    assert all(21000 <= p <= 21099 for p in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed


def test_a_range_wholly_taken_still_gives_a_free_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setenv(PORT_RANGE_ENV, f"{taken}-{taken}")
        port = free_port()
        assert port != taken
    monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port}")
    assert free_port() == port


def test_without_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    low, high = map(int, ephemeral)
    assert low <= free_port() <= high
