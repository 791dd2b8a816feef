"""The health monitor's probe of the run's peers (``ckptd.daemon.health_loop``): a real peer
port on loopback answers its signed hello, so the peers are reachable; once it is gone
(its port closed) the probe says so, with why; another token is no answer either; and a
node with no announced peer judges nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ckptd.config import Settings
from ckptd.daemon.health_loop import DaemonActions, HealthNoticeSource
from ckptd.health.store import Reachability
from ckptd.runtime.clock import SYSTEM_CLOCK
from tests.support.peers import Holder


def actions_for(addresses: list[str], token: bytes) -> DaemonActions:
    settings = Settings(health={"enabled": True, "unreachable_seconds": 0.3})
    peering = SimpleNamespace(token=token, peer_addresses=lambda: list(addresses))
    service: Any = SimpleNamespace(
        settings=settings,
        storage=SimpleNamespace(probe=lambda: None),
        clock=SYSTEM_CLOCK,
        peering=peering,
    )
    return DaemonActions(service, HealthNoticeSource())


def reading_until(actions: DaemonActions, wanted: bool, timeout: float = 30) -> str:
    """Poll as the monitor does until the peers' reading is ``wanted``; its error."""
    deadline = time.monotonic() + timeout
    while True:
        got = actions.peers()
        assert got is not None
        if got[0] is wanted:
            return got[1]
        assert time.monotonic() < deadline, f"the peers never read {wanted}: {got}"
        time.sleep(0.05)


async def test_the_peers_are_reachable_while_one_answers_and_cut_off_once_none_does(
    tmp_path: Path,
) -> None:
    holder = await Holder(tmp_path / "holder").start()
    gone = Holder(tmp_path / "gone")  # announced, never started: its port refuses
    actions = actions_for([gone.address, holder.address], holder.token)
    try:
        await asyncio.to_thread(reading_until, actions, True)
        # Answered while one of two answers; then the one that did goes away.
        await holder.stop()
        why = await asyncio.to_thread(reading_until, actions, False)
        assert "no peer answered" in why and holder.address in why
    finally:
        await holder.stop()


async def test_a_peer_signed_for_with_another_token_is_no_answer(tmp_path: Path) -> None:
    holder = await Holder(tmp_path / "holder").start()
    try:
        actions = actions_for([holder.address], b"another-token-of-32-bytes-xxxxxx")
        why = await asyncio.to_thread(reading_until, actions, False)
        assert "401" in why
    finally:
        await holder.stop()


def test_a_node_with_no_announced_peer_judges_nothing() -> None:
    assert actions_for([], b"x" * 32).peers() is None


def test_an_outage_of_every_peer_is_one_degrading_event_once_it_lasted() -> None:
    reach = Reachability(30, source="peers", kind="peers-unreachable", what="every peer")
    assert reach.reading(False, "no peer answered", 100.0) is None
    event = reach.reading(False, "no peer answered", 131.0)
    assert event is not None and (event.source, event.kind) == ("peers", "peers-unreachable")
    assert event.severity == "degrading" and "every peer" in event.message
    assert reach.reading(False, "no peer answered", 140.0) is None  # one per outage
    assert reach.reading(True, "", 141.0) is None and not reach.lost
