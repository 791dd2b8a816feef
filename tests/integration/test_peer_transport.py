"""The peer port and the push against it, on loopback: what a holder acknowledges is what
the origin's files hold, byte for byte, and nothing else is ever acknowledged or kept.

Faults come from the loopback fault proxy in front of the holder (a bit flipped in a
chunk's body, connections cut mid-body) and from the holder itself (restarted, full,
given paths that climb out); the client is never mocked.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest

from ckptd.core import checksum, digest
from ckptd.peers import auth
from ckptd.peers.client import PeerClient, PeerError
from ckptd.peers.model import Offer, chunk_spans
from ckptd.peers.receiving import Receiver
from ckptd.peers.replicas import ReplicaError, ReplicaStore
from ckptd.runtime.clock import SYSTEM_CLOCK
from ckptd.runtime.logs import get_logger
from tests.support.fakes import wait_until
from tests.support.faultproxy import FaultProxy
from tests.support.peers import TOKEN, Holder, header, push, write_part

MiB = 1024 * 1024
SIZES = {"model.distcp": 20 * MiB + 123, "sub/rng.pt": 1000, "empty": 0}


@pytest.fixture
async def holder(tmp_path: Path) -> Holder:
    held = await Holder(tmp_path / "replicas").start()
    yield held  # type: ignore[misc]
    await held.stop()


@pytest.fixture
async def client() -> PeerClient:
    c = PeerClient(TOKEN, SYSTEM_CLOCK)
    yield c  # type: ignore[misc]
    await c.close()


def crc_of(data: bytes) -> str:
    return checksum.to_hex(checksum.crc32c(data))


async def test_a_pushed_part_is_held_byte_identical_and_acknowledged_by_its_content(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", SIZES)
    result = await push(client, holder, files)
    held = holder.held_files(result.replica_id)
    assert held == {f.path: f.local.read_bytes() for f in files}
    by_path = {f.path: f for f in result.replica.files}
    for f in files:
        assert by_path[f.path].crc32c == crc_of(f.local.read_bytes())
        assert by_path[f.path].size == f.size
    listed = holder.store.holdings("run") if holder.store else []
    assert [h.id for h in listed] == [result.replica_id]
    assert holder.incoming() == []  # nothing left half-received


async def test_authenticated_parts_are_held_to_their_blake3_digests(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", SIZES)
    result = await push(client, holder, files, digests=True)
    assert result.replica.digest == digest.ALGORITHM
    for entry, f in zip(result.replica.files, files, strict=True):
        assert entry.digest == digest.digest_of_bytes(f.local.read_bytes())


async def test_without_the_token_a_client_can_neither_write_nor_read(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", SIZES)
    stranger = PeerClient(b"not-the-cluster-token-0123456789", SYSTEM_CLOCK)
    try:
        with pytest.raises(PeerError) as refused:
            await push(stranger, holder, files)
        assert refused.value.reason == "unauthorized"
        assert holder.incoming() == []
        with pytest.raises(PeerError):
            await stranger.hello(holder.address)
    finally:
        await stranger.close()
    result = await push(client, holder, files)  # the cluster's own client is served
    base = f"http://{holder.address}"
    file_url = f"/v1/peer/holdings/{result.replica_id}/files/0"
    wrong, _ = auth.sign(b"not-the-cluster-token-0123456789", "GET", file_url, SYSTEM_CLOCK.time())
    async with aiohttp.ClientSession() as raw:
        for path, headers in (
            ("/v1/peer/holdings?run=run", {}),
            (file_url, {}),
            (file_url, {"Authorization": wrong}),
            (
                file_url,
                {"Authorization": "Bearer " + TOKEN.decode()},
            ),  # the token in clear is no signature
        ):
            async with raw.get(base + path, headers=headers) as r:
                body = await r.read()
                assert r.status == 401, (path, r.status)
                assert files[0].local.read_bytes()[:64] not in body
    assert holder.refused("unauthorized") >= 6


async def test_a_replayed_request_is_refused(holder: Holder) -> None:
    target = "/v1/peer/holdings?run=run"
    signed, _ = auth.sign(TOKEN, "GET", target, SYSTEM_CLOCK.time())
    async with aiohttp.ClientSession() as raw:
        statuses = []
        for _ in range(2):
            async with raw.get(
                f"http://{holder.address}{target}", headers={"Authorization": signed}
            ) as r:
                statuses.append(r.status)
    assert statuses == [200, 401]


async def test_a_bit_flipped_in_transit_is_refused_never_written_and_sent_again(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", SIZES)
    with FaultProxy(f"http://{holder.address}") as proxy:
        proxy.fail_next(1, "flip-bit", methods={"PUT"})
        result = await push(client, proxy.url.removeprefix("http://"), files)
        assert proxy.faults_injected == 1
    assert holder.refused("corrupt") == 1
    assert holder.held_files(result.replica_id) == {f.path: f.local.read_bytes() for f in files}


async def test_a_link_that_damages_every_chunk_never_gets_a_part_acknowledged(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", SIZES)
    with FaultProxy(f"http://{holder.address}") as proxy:
        proxy.set_faults(rate=1.0, kinds=("flip-bit",), methods={"PUT"})
        with pytest.raises(PeerError) as failed:
            await push(client, proxy.url.removeprefix("http://"), files)
        # Given up: the client tells the holder in the background (through the proxy,
        # so before it closes), and the holder then drops the reservation and the
        # files; on a loaded machine that lands after push() returns.
        await wait_until(lambda: holder.incoming() == [], 30.0, "the holder to drop the transfer")
    assert failed.value.reason == "corrupt"
    assert holder.store is not None and holder.store.held() == []


async def test_connections_cut_mid_chunk_resume_from_the_chunk_they_cut(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"big": 40 * MiB})
    chunks = len(chunk_spans(40 * MiB))
    with FaultProxy(f"http://{holder.address}") as proxy:
        proxy.set_faults(rate=0.3, kinds=("reset",), methods={"PUT"}, seed=3)
        result = await push(client, proxy.url.removeprefix("http://"), files)
        cut = proxy.faults_injected
        puts = proxy.count("PUT")
    assert cut >= 1
    # Each cut costs one chunk sent again, never the push from its start.
    assert puts == chunks + cut
    assert holder.held_files(result.replica_id) == {"big": files[0].local.read_bytes()}


async def test_a_holder_restarted_mid_transfer_never_acknowledges_the_part(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"big": 48 * MiB})

    async def restart_once_some_arrived() -> None:
        while holder.metrics.peer_received_bytes._value.get() < 8 * MiB:
            await asyncio.sleep(0.01)
        await holder.stop()
        await holder.start()

    restarting = asyncio.create_task(restart_once_some_arrived())
    with pytest.raises(PeerError) as failed:
        # Paced so that the restart lands mid-transfer.
        await push(client, holder, files, rate_mbit=160, deadline_s=20)
    await restarting
    assert failed.value.reason in ("restarted", "unreachable")
    assert holder.store is not None and holder.store.held() == []
    assert holder.incoming() == []  # what arrived before the restart is discarded


async def test_a_part_larger_than_the_quota_is_refused_before_a_byte_is_sent(
    tmp_path: Path, client: PeerClient
) -> None:
    small = await Holder(tmp_path / "replicas", quota_bytes=4 * MiB).start()
    try:
        files = write_part(tmp_path / "node", {"big": 8 * MiB})
        with pytest.raises(PeerError) as refused:
            await push(client, small, files)
        assert refused.value.reason == "quota"
        assert small.refused("quota") == 1
        assert small.metrics.peer_received_bytes._value.get() == 0
        assert small.incoming() == []
    finally:
        await small.stop()


async def test_the_oldest_replica_is_evicted_first_to_make_room(
    tmp_path: Path, client: PeerClient
) -> None:
    held = await Holder(tmp_path / "replicas", quota_bytes=10 * MiB).start()
    try:
        ids = []
        for step in (10, 20, 30):
            files = write_part(tmp_path / f"node-{step}", {"part": 4 * MiB}, seed=step)
            result = await push(client, held, files, name=f"step-{step}", save=f"{step:08x}")
            ids.append(result.replica_id)
        assert held.store is not None
        assert [h.id for h in held.store.held()] == ids[1:]
        assert not (held.root / "held" / ids[0]).exists()
        assert held.store.used_bytes() <= 10 * MiB
    finally:
        await held.stop()


async def test_an_offer_whose_path_climbs_out_is_refused_and_writes_nothing(
    tmp_path: Path, holder: Holder
) -> None:
    doc = header().model_dump(mode="json", exclude={"environment"})
    doc["files"], doc["total_bytes"] = [{"path": "../escape", "size": 1}], 1
    raw_body = json.dumps(doc).encode()
    target = "/v1/peer/transfers"
    signed, _ = auth.sign(TOKEN, "POST", target, SYSTEM_CLOCK.time(), auth.body_sha256(raw_body))
    async with (
        aiohttp.ClientSession() as raw,
        raw.post(
            f"http://{holder.address}{target}",
            data=raw_body,
            headers={"Authorization": signed, "Content-Type": "application/json"},
        ) as r,
    ):
        assert r.status == 400
    assert not (holder.root.parent / "escape").exists()
    assert holder.incoming() == []


def test_a_symlink_planted_in_the_replica_dir_redirects_no_write(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "replicas", 1 << 30, get_logger())
    store.open()
    receiver = Receiver(store)
    try:
        offer = Offer.model_validate(
            {
                **header().model_dump(mode="json", exclude={"files", "environment"}),
                "files": [{"path": "a/b.bin", "size": 4}],
                "total_bytes": 4,
            }
        )
        tid = receiver.begin(offer, 0.0)
        outside = tmp_path / "outside.bin"
        outside.write_bytes(b"keep")
        planted = tmp_path / "replicas" / "incoming" / tid / "data" / "a"
        for child in planted.iterdir():
            child.unlink()
        planted.rmdir()
        planted.symlink_to(tmp_path)  # a/ now points out of the replica dir
        (tmp_path / "b.bin").write_bytes(b"zzzz")
        with pytest.raises(ReplicaError):
            receiver.write_chunk(tid, 0, 0, b"evil", crc_of(b"evil"), 0.0)
        assert outside.read_bytes() == b"keep"
        assert (tmp_path / "b.bin").read_bytes() == b"zzzz"
    finally:
        store.close()


async def test_a_file_the_trainer_rewrites_mid_push_never_seals(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"big": 40 * MiB})

    async def rewrite_once_some_arrived() -> None:
        while holder.metrics.peer_received_bytes._value.get() < 8 * MiB:
            await asyncio.sleep(0.01)
        with open(files[0].local, "r+b") as fh:
            fh.seek(30 * MiB)
            fh.write(b"new save")
        os.utime(files[0].local, ns=(1, 1))

    rewriting = asyncio.create_task(rewrite_once_some_arrived())
    with pytest.raises(PeerError) as failed:
        await push(client, holder, files, rate_mbit=200)
    await rewriting
    assert failed.value.reason == "changed"
    assert holder.store is not None and holder.store.held() == []


async def test_a_file_damaged_at_rest_is_not_served(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"part": 2 * MiB})
    result = await push(client, holder, files)
    os.truncate(holder.root / "held" / result.replica_id / "data" / "part", MiB)
    target = f"/v1/peer/holdings/{result.replica_id}/files/0"
    signed, _ = auth.sign(TOKEN, "GET", target, SYSTEM_CLOCK.time())
    async with (
        aiohttp.ClientSession() as raw,
        raw.get(f"http://{holder.address}{target}", headers={"Authorization": signed}) as r,
    ):
        assert r.status == 409
