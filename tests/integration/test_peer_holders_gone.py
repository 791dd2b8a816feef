"""Holders that go away, on loopback: a push to a holder that stops answering mid-push,
or gets a notice, is given up within ``ckptd.peers.liveness``'s bounds and the next
candidate takes the part (``ckptd.peers.copies``); a holder that goes after it
acknowledged is dropped and replaced while the part is not in the store.

Real holders (``PeerServer`` over a ``ReplicaStore``), the real client, the loopback
fault proxy in front of a holder to make it go silent (every new request held
unanswered, as a host that vanished: no RST, no answer); nothing is mocked. The rig
tests (tests/e2e/test_peers_notices.py) do the same with daemons, killed hosts and cut
links.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.peers.client import LocalFile, PeerAbandonedError, PeerClient
from ckptd.peers.copies import Copies, Part
from ckptd.peers.liveness import PROBE_SECONDS, REPLACED_WITHIN_SECONDS
from ckptd.peers.model import PeerAnnouncement
from ckptd.peers.pacing import Pace
from ckptd.runtime.clock import SYSTEM_CLOCK
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from tests.support.faultproxy import FaultProxy
from tests.support.peers import TOKEN, Holder, header, push, write_part

MiB = 1024 * 1024
# Slack for a loaded 2-core machine on top of the documented bound.
SLACK = 1.5


@pytest.fixture
async def client() -> AsyncIterator[PeerClient]:
    c = PeerClient(TOKEN, SYSTEM_CLOCK)
    yield c
    await c.close()


@pytest.fixture
async def holders(tmp_path: Path) -> AsyncIterator[list[Holder]]:
    found = [await Holder(tmp_path / f"h{i}", peer_id=f"peer-{i + 1}").start() for i in range(3)]
    yield found
    for h in found:
        await h.stop()


def announced(rank: int, address: str) -> PeerAnnouncement:
    return PeerAnnouncement.model_validate(
        {
            "run_id": "run",
            "node_rank": rank,
            "nodes": 4,
            "peer": f"peer-{rank}",
            "incarnation": "i",
            "host": f"node-{rank}",
            "address": address,
            "quota_bytes": 1 << 30,
            "free_bytes": 1 << 30,
            "updated_at": time.time(),
        }
    )


async def cut_when(proxy: FaultProxy, sent: int) -> float:
    """Once ``sent`` bytes went up through ``proxy``, every new request is held
    unanswered (the holder vanished); when that was (monotonic)."""
    while proxy.bytes_up < sent:
        await asyncio.sleep(0.02)
    proxy.deny("timeout")
    return time.monotonic()


def copies_over(
    client: PeerClient, order: list[PeerAnnouncement], noticed: set[int] | None = None
) -> Copies:
    """``Copies`` whose candidates are ``order`` (less the ranks in ``noticed``)."""
    marked = noticed if noticed is not None else set()
    return Copies(
        client,
        targets=lambda run, size: [a for a in order if a.node_rank not in marked],
        noticed=lambda run, rank: rank in marked,
        digests=False,
        on_bytes=lambda n: None,
        metrics=Metrics(),
        clock=SYSTEM_CLOCK,
        log=get_logger(),
    )


def part_of(files: list[LocalFile], *, rate_mbit: float = 0, seconds: float = 60) -> Part:
    return Part(
        header(),
        files,
        Pace.of_mbit(rate_mbit, SYSTEM_CLOCK.monotonic),
        SYSTEM_CLOCK.monotonic() + seconds,
        1,
        [],
    )


async def test_a_holder_that_goes_silent_mid_push_is_abandoned_within_the_bound(
    tmp_path: Path, holders: list[Holder], client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 48 * MiB})
    with FaultProxy(f"http://{holders[0].address}", stall_seconds=60) as proxy:
        cut = asyncio.ensure_future(cut_when(proxy, 12 * MiB))
        with pytest.raises(PeerAbandonedError) as caught:
            await push(client, proxy.url.removeprefix("http://"), files, rate_mbit=100)
        gone_after = time.monotonic() - await cut
    assert caught.value.why in ("silent", "stalled"), caught.value
    assert caught.value.reason == "abandoned"
    assert gone_after <= REPLACED_WITHIN_SECONDS + SLACK, gone_after


async def test_a_holder_that_gets_a_notice_mid_push_refuses_and_is_abandoned_at_once(
    tmp_path: Path, holders: list[Holder], client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 48 * MiB})
    holder = holders[0]

    async def notice_soon() -> float:
        while holder.metrics.peer_received_bytes._value.get() < 8 * MiB:
            await asyncio.sleep(0.02)
        holder.noticed = True
        return time.monotonic()

    noticed = asyncio.ensure_future(notice_soon())
    with pytest.raises(PeerAbandonedError) as caught:
        await push(client, holder, files, rate_mbit=100)
    assert caught.value.why == "notice"
    assert time.monotonic() - await noticed <= PROBE_SECONDS + SLACK
    assert holder.refused("notice") >= 1
    assert holder.store is not None and holder.store.held() == []


async def test_a_holder_with_a_notice_refuses_the_offer(
    tmp_path: Path, holders: list[Holder], client: PeerClient
) -> None:
    holders[0].noticed = True
    files = write_part(tmp_path / "node", {"model.distcp": MiB})
    with pytest.raises(PeerAbandonedError) as caught:
        await push(client, holders[0], files)
    assert caught.value.why == "notice"
    assert holders[0].incoming() == []


async def test_the_part_moves_to_the_next_candidate_when_its_holder_goes_silent_mid_push(
    tmp_path: Path, holders: list[Holder], client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 48 * MiB, "rng.pt": 1000})
    with FaultProxy(f"http://{holders[0].address}", stall_seconds=60) as proxy:
        order = [
            announced(1, proxy.url.removeprefix("http://")),
            announced(2, holders[1].address),
        ]
        part = part_of(files, rate_mbit=100)
        cut = asyncio.ensure_future(cut_when(proxy, 12 * MiB))
        await copies_over(client, order).place(part)
        cut_at = await cut
    assert [h.target.node_rank for h in part.held] == [2]
    assert [(e["node"], e["outcome"]) for e in part.entries] == [
        (1, "abandoned"),
        (2, "acknowledged"),
    ]
    held = holders[1].held_files(part.held[0].result.replica_id)
    assert held == {f.path: f.local.read_bytes() for f in files}
    # The second push began within the bound of the first holder's going.
    assert part.entries[0]["why"] in ("silent", "stalled")
    assert time.monotonic() - cut_at < REPLACED_WITHIN_SECONDS + SLACK + 48 * 8 / 100 + 5


async def test_a_node_under_notice_is_never_pushed_to_and_an_ack_from_one_does_not_count(
    tmp_path: Path, holders: list[Holder], client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 2 * MiB})
    order = [announced(1, holders[0].address), announced(2, holders[1].address)]
    part = part_of(files)
    await copies_over(client, order, noticed={1}).place(part)
    assert [h.target.node_rank for h in part.held] == [2]
    assert holders[0].metrics.peer_received_bytes._value.get() == 0

    # A candidate whose notice becomes known while its push runs: acknowledged, not counted.
    marked: set[int] = set()
    copies = copies_over(client, order, noticed=marked)
    real_push = client.push

    async def push_then_noticed(address: str, *args: Any, **kwargs: Any) -> Any:
        result = await real_push(address, *args, **kwargs)
        if address == holders[0].address:
            marked.add(1)
        return result

    client.push = push_then_noticed  # type: ignore[method-assign]
    again = part_of(files)
    await copies.place(again)
    assert [(e["node"], e["outcome"]) for e in again.entries] == [
        (1, "notice"),
        (2, "acknowledged"),
    ]
    assert [h.target.node_rank for h in again.held] == [2]


async def test_a_holder_that_gets_a_notice_after_it_acknowledged_is_dropped_and_replaced(
    tmp_path: Path, holders: list[Holder], client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 4 * MiB})
    order = [announced(r + 1, h.address) for r, h in enumerate(holders)]
    copies = copies_over(client, order)
    part = part_of(files)
    await copies.place(part)
    assert [h.target.node_rank for h in part.held] == [1]
    changes: list[list[int]] = []
    keeper = asyncio.ensure_future(
        copies.keep(part, lambda p: changes.append([h.target.node_rank for h in p.held]))
    )
    try:
        holders[0].noticed = True
        noticed = time.monotonic()
        while not changes:
            await asyncio.sleep(0.05)
            assert time.monotonic() - noticed < 15, part.entries
        took = time.monotonic() - noticed
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
    assert changes == [[2]]
    assert part.entries[0]["outcome"] == "dropped:notice"
    assert took <= 2 * PROBE_SECONDS + SLACK + 2, took


async def test_a_holder_that_stops_answering_after_it_acknowledged_is_dropped_and_replaced(
    tmp_path: Path, holders: list[Holder], client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 4 * MiB})
    order = [announced(r + 1, h.address) for r, h in enumerate(holders)]
    copies = copies_over(client, order)
    part = part_of(files)
    await copies.place(part)
    changes: list[list[int]] = []
    keeper = asyncio.ensure_future(
        copies.keep(part, lambda p: changes.append([h.target.node_rank for h in p.held]))
    )
    try:
        await holders[0].stop()
        gone = time.monotonic()
        while not changes:
            await asyncio.sleep(0.05)
            assert time.monotonic() - gone < 20, part.entries
        took = time.monotonic() - gone
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
    assert changes == [[2]]
    assert part.entries[0]["outcome"] == "dropped:silent"
    assert took <= REPLACED_WITHIN_SECONDS + PROBE_SECONDS + SLACK + 2, took
