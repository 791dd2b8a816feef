"""SIGTERM as a notice: real signals sent to this test process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from types import FrameType

import pytest

from ckptd.notices.sigterm import SigtermSource
from tests.support.fakes import Collector, wait_until


@pytest.fixture
def recorded_sigterm() -> Iterator[list[int]]:
    """A Python-level SIGTERM handler that records, standing for "what was there before"."""
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_sigterm_yields_one_notice_with_the_grace_as_deadline(
    recorded_sigterm: list[int],
) -> None:
    source = SigtermSource(grace=15)
    source.install()  # before any signal: the process must never die of it
    async with Collector(source) as notices:
        os.kill(os.getpid(), signal.SIGTERM)
        notice = await notices.next(3)
        assert (notice.source, notice.kind, notice.cancelled) == ("sigterm", "sigterm", False)
        assert notice.deadline == notice.noticed_at + timedelta(seconds=15)
        assert notice.to_json()["source"] == "sigterm"
        # A second SIGTERM is absorbed: no second notice, and the process lives on.
        os.kill(os.getpid(), signal.SIGTERM)
        await wait_until(lambda: source.count == 2, what="the second signal")
        await notices.expect_nothing(0.1)
    assert recorded_sigterm == []  # our handler, not the previous one, got both


async def test_the_end_of_the_watch_restores_the_previous_handler(
    recorded_sigterm: list[int],
) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    source = SigtermSource()
    async with Collector(source):
        await wait_until(lambda: source.installed, what="the handler")
        assert signal.getsignal(signal.SIGTERM) is not previous
    assert not source.installed
    assert signal.getsignal(signal.SIGTERM) is previous
    os.kill(os.getpid(), signal.SIGTERM)
    await wait_until(lambda: recorded_sigterm == [signal.SIGTERM], what="the previous handler")


async def test_close_is_idempotent_and_install_can_repeat(recorded_sigterm: list[int]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    source = SigtermSource()
    source.install()
    source.install()
    source.close()
    source.close()
    assert signal.getsignal(signal.SIGTERM) is previous


async def test_signal_before_the_watch_starts_is_not_lost(recorded_sigterm: list[int]) -> None:
    source = SigtermSource(grace=1)
    source.install()
    os.kill(os.getpid(), signal.SIGTERM)
    await wait_until(lambda: source.count == 1, what="the signal")
    async with Collector(source) as notices:
        notice = await notices.next(3)
        assert notice.deadline == notice.noticed_at + timedelta(seconds=1)
