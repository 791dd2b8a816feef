"""Restore from peers first: the bytes come from a peer holding exactly the committed
content, every file held to the store's manifest, and anything a peer gets wrong (a bit
flipped or a file cut short at rest, another save's replica, no answer, a wrong token)
is detected, never restored, and read from the store instead.

A real holder (``PeerServer`` over a ``ReplicaStore``) on loopback holds a replica pushed
by the real client; the store is a ``file://`` destination holding the committed
checkpoint and the holder's peer announcement.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ckptd.commit.single import commit
from ckptd.config import Settings
from ckptd.core import checksum
from ckptd.core.manifest import build_manifest
from ckptd.peers import source
from ckptd.peers.client import PeerClient
from ckptd.peers.discovery import write_announcement
from ckptd.peers.model import PeerAnnouncement
from ckptd.peers.source import HOLDINGS_GRACE_SECONDS, PEERS_TIER, credited, peers_tier
from ckptd.repository import Repository, object_key
from ckptd.runtime.clock import SYSTEM_CLOCK
from ckptd.runtime.logs import get_logger
from ckptd.storage.base import RangeSink
from ckptd.storage.wrapper import StorageWrapper
from ckptd.store.restore import RestoreRequest
from ckptd.store.tiers import TierStore, open_tiers, restore_from_tiers
from tests.support.peers import TOKEN, Holder, push, write_part

MiB = 1024 * 1024
NAME = "step-10"
SIZES = {"__0_0.distcp": 6 * MiB + 17, "__1_0.distcp": 5 * MiB, ".metadata": 900}


def settings_for(tmp_path: Path, token: bytes = TOKEN, wait: float = 3.0) -> Settings:
    token_file = tmp_path / "cluster.token"
    token_file.write_bytes(token)
    return Settings(
        destination={"url": f"file://{tmp_path / 'store'}"},
        state={"dir": tmp_path / "state"},
        cluster={"nodes": 2, "node_rank": 0},
        peers={
            "enabled": True,
            "token_file": str(token_file),
            "quota_gib": 1,
            "restore_wait_seconds": wait,
        },
    )


def commit_files(settings: Settings, files: dict[str, bytes], name: str = NAME) -> None:
    """The checkpoint committed in the store as any ship leaves it: objects, manifest."""
    tier = open_tiers(settings)[0]
    entries = []
    for rel, data in files.items():
        crc = checksum.crc32c(data)
        tier.storage.put_bytes(object_key("run", name, rel), data, crc32c=crc)
        entries.append((rel, len(data), checksum.to_hex(crc)))
    manifest = build_manifest(
        run_id="run",
        checkpoint=name,
        step=10,
        layout="dcp",
        host="node-0",
        created_at=0.0,
        committed_at=1.0,
        files=entries,
        environment={},
    )
    commit(tier.storage, manifest)


def announce(
    settings: Settings, holder: Holder | None, rank: int = 1, address: str | None = None
) -> None:
    repo = Repository(open_tiers(settings)[0].storage)
    doc = PeerAnnouncement(
        run_id="run",
        node_rank=rank,
        nodes=2,
        peer=f"peer-{rank}",
        incarnation="i",
        host=f"node-{rank}",
        address=address or (holder.address if holder is not None else ""),
        quota_bytes=1 << 30,
        free_bytes=1 << 30,
        updated_at=SYSTEM_CLOCK.time(),
    )
    write_announcement(repo, doc)


class SlowReads(StorageWrapper):
    """The store, each ranged read of a file ``seconds`` late (a slow link's worth)."""

    seconds = 0.0

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        time.sleep(self.seconds)
        self.inner.stream_range(key, start, length, sink)


def restore_with_peers(
    settings: Settings, to: Path, *, store_read_seconds: float = 0.0, seen: list[Any] | None = None
) -> tuple[Any, int]:
    """``ckptd restore --latest`` as the CLI runs it with peers: (TierRestore, peer bytes).
    ``store_read_seconds``: each ranged read of the store that late, 1 MiB ranges one at a
    time; ``seen``: gets the peers tier, if any."""
    tiers = open_tiers(settings)
    request = RestoreRequest("run", None, to, progress=False, take_lease=False)
    if store_read_seconds:
        slow = SlowReads(tiers[0].storage)
        slow.seconds = store_read_seconds
        tiers = [TierStore(tiers[0].name, slow, tiers[0].config)]
        request = replace(request, concurrency=1, chunk_bytes=MiB)
    peers, slot = peers_tier(settings, tiers, "run", None, None, get_logger())
    if seen is not None:
        seen.append(peers)
    if peers is not None:
        tiers = [peers.tier, *tiers]
        request = replace(request, checkpoint=slot)
    done = credited(restore_from_tiers(tiers, request), peers)
    return done, done.peer_bytes


@pytest.fixture
async def scene(tmp_path: Path) -> Any:
    """The committed checkpoint in the store, and a holder of a replica of it, announced."""
    settings = settings_for(tmp_path)
    files = write_part(tmp_path / "node" / NAME, SIZES, seed=5)
    data = {f.path: f.local.read_bytes() for f in files}
    commit_files(settings, data)
    holder = await Holder(tmp_path / "replicas").start()
    client = PeerClient(TOKEN, SYSTEM_CLOCK)
    result = await push(client, holder, files, name=NAME)
    await client.close()
    announce(settings, holder)
    yield settings, holder, data, result.replica_id
    await holder.stop()


def restored(to: Path) -> dict[str, bytes]:
    base = to / NAME
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}


async def test_a_replacement_restores_every_byte_from_its_peer_verified(
    tmp_path: Path, scene: Any
) -> None:
    settings, _holder, data, _ = scene
    done, from_peers = await asyncio.to_thread(restore_with_peers, settings, tmp_path / "to")
    assert done.tier == PEERS_TIER
    assert from_peers == sum(len(b) for b in data.values())
    assert done.store_bytes == 0
    assert restored(tmp_path / "to") == data


async def test_a_peer_answering_late_still_serves_what_the_store_has_not_started(
    tmp_path: Path, scene: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The peer's holdings come 0.8 s after it is asked (past the grace): the store starts
    # meanwhile, each 1 MiB range 1.0 s late; the ranges not started by the answer come
    # from the peer.
    settings, _holder, data, _ = scene
    late = HOLDINGS_GRACE_SECONDS + 0.3
    holdings = source.PeerReader.holdings

    def slow_holdings(self: Any, address: str, run: str, timeout: float) -> Any:
        time.sleep(late)
        return holdings(self, address, run, timeout)

    monkeypatch.setattr(source.PeerReader, "holdings", slow_holdings)
    done, from_peers = await asyncio.to_thread(
        functools.partial(restore_with_peers, store_read_seconds=1.0),
        settings,
        tmp_path / "to",
    )
    total = sum(len(b) for b in data.values())
    assert restored(tmp_path / "to") == data
    assert done.tier == PEERS_TIER
    assert 0 < from_peers < total and done.store_bytes == total - from_peers, done


async def test_a_silent_peer_is_not_waited_for(tmp_path: Path, scene: Any) -> None:
    # A peer whose port takes connections and never answers (its process hung, or its
    # answers dropped): the store restores everything while that peer is still asked.
    settings, holder, data, _ = scene
    await holder.stop()
    silent = socket.create_server(("127.0.0.1", 0), backlog=8)  # never accepts
    try:
        announce(settings, None, address=f"127.0.0.1:{silent.getsockname()[1]}")
        slow = settings.model_copy(
            update={"peers": settings.peers.model_copy(update={"restore_wait_seconds": 30})}
        )
        seen: list[Any] = []
        done, from_peers = await asyncio.to_thread(
            functools.partial(restore_with_peers, seen=seen), slow, tmp_path / "to"
        )
        asked = seen[0].storage.answers
        assert not asked.settled()  # done without its answer
    finally:
        silent.close()
    assert (done.tier, from_peers) == ("primary", 0)
    assert done.store_bytes == sum(len(b) for b in data.values())
    assert restored(tmp_path / "to") == data


@pytest.mark.parametrize("fault", ["bit-flip", "truncation"])
async def test_a_replica_damaged_at_rest_is_never_restored_and_the_store_fills_in(
    tmp_path: Path, scene: Any, fault: str
) -> None:
    settings, holder, data, rid = scene
    damaged = holder.root / "held" / rid / "data" / "__0_0.distcp"
    if fault == "bit-flip":
        with open(damaged, "r+b") as fh:
            fh.seek(3 * MiB + 11)
            byte = fh.read(1)
            fh.seek(3 * MiB + 11)
            fh.write(bytes([byte[0] ^ 0x10]))
    else:
        os.truncate(damaged, 2 * MiB)
    done, _ = await asyncio.to_thread(restore_with_peers, settings, tmp_path / "to")
    assert restored(tmp_path / "to") == data  # every byte as committed
    if fault == "bit-flip":
        # The damaged file failed its CRC-32C: the peers tier failed, the store restored
        # it (the files that verified from the peer were kept, not fetched again).
        assert done.tier == "primary" and done.skipped_tiers == (PEERS_TIER,)
    else:
        assert holder.refused("changed") >= 1  # a file not of its size is not served


async def test_a_peer_holding_another_save_serves_nothing(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    stale = write_part(tmp_path / "old" / NAME, SIZES, seed=1)  # an older save, same name
    files = write_part(tmp_path / "node" / NAME, SIZES, seed=2)
    commit_files(settings, {f.path: f.local.read_bytes() for f in files})
    holder = await Holder(tmp_path / "replicas").start()
    client = PeerClient(TOKEN, SYSTEM_CLOCK)
    try:
        await push(client, holder, stale, name=NAME, save="0ldsave0")
        announce(settings, holder)
        done, from_peers = await asyncio.to_thread(restore_with_peers, settings, tmp_path / "to")
    finally:
        await client.close()
        await holder.stop()
    assert (done.tier, from_peers) == ("primary", 0)
    assert restored(tmp_path / "to") == {f.path: f.local.read_bytes() for f in files}


async def test_with_a_wrong_token_nothing_is_read_from_peers(tmp_path: Path, scene: Any) -> None:
    _, holder, data, _ = scene
    wrong = settings_for(tmp_path, token=b"not-the-cluster-token-0123456789")
    done, from_peers = await asyncio.to_thread(restore_with_peers, wrong, tmp_path / "to")
    assert (done.tier, from_peers) == ("primary", 0)
    assert holder.refused("unauthorized") >= 1
    assert restored(tmp_path / "to") == data


async def test_with_no_peer_answering_the_store_restores_within_the_wait(
    tmp_path: Path, scene: Any
) -> None:
    settings, holder, data, _ = scene
    await holder.stop()  # nothing answers at its address now
    started = time.monotonic()
    done, from_peers = await asyncio.to_thread(restore_with_peers, settings, tmp_path / "to")
    assert time.monotonic() - started < settings.peers.restore_wait_seconds + 10
    assert (done.tier, from_peers) == ("primary", 0)
    assert restored(tmp_path / "to") == data


def test_random_sizes_route_only_whole_matching_files(tmp_path: Path) -> None:
    # The routes a restore takes are all-or-nothing per file: a holding whose file differs
    # in size or CRC-32C never serves it, however close.
    from ckptd.core.manifest import ManifestFile
    from ckptd.peers.model import Holding, routes

    rng = random.Random(0)
    wanted = [
        ManifestFile(path=f"f{i}", size=rng.randrange(1, 99), crc32c=f"{rng.getrandbits(32):08x}")
        for i in range(20)
    ]
    near = [
        ManifestFile(path=f.path, size=f.size + (i % 2), crc32c=f.crc32c if i % 2 else "00000000")
        for i, f in enumerate(wanted)
    ]
    holding = Holding(
        id="h",
        kind="replica",
        run_id="run",
        checkpoint=NAME,
        name=NAME,
        save="s",
        node_rank=1,
        files=near,
    )
    assert routes(wanted, {"a:1": [holding]}) == {}


def test_only_fresh_announcements_of_the_run_name_peers_to_ask(tmp_path: Path) -> None:
    from ckptd.peers.source import fresh_peers
    from ckptd.repository import peer_key

    settings = settings_for(tmp_path)
    repo = Repository(open_tiers(settings)[0].storage)
    now = SYSTEM_CLOCK.time()
    for rank, run, updated_at in ((1, "run", now), (2, "run", now - 3600), (3, "other", now)):
        doc = PeerAnnouncement(
            run_id=run,
            node_rank=rank,
            nodes=4,
            peer=f"peer-{rank}",
            incarnation="i",
            host=f"node-{rank}",
            address=f"10.0.0.{rank}:9465",
            quota_bytes=1,
            free_bytes=1,
            updated_at=updated_at,
        )
        repo.put_json(peer_key("run", rank), doc.to_bytes())  # rank 3: another run's, here
    repo.put_json(peer_key("run", 4), b"{not json")
    assert fresh_peers(repo, "run", stale_after=60) == ["10.0.0.1:9465"]
