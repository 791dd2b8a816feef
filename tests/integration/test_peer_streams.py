"""The peer port's streams (``ckptd.peers.frames``) on loopback: a push over them keeps
every guarantee of the HTTP chunks, and a read over them is the held file's bytes.

Wire faults come from ``StreamProxy``, a TCP proxy that reads the frames on their way
up (a bit flipped in a chunk's body, a connection cut mid-body, a holder gone silent);
signatures are checked with raw frames on a socket; the client is never mocked.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ckptd.core import checksum
from ckptd.peers import auth
from ckptd.peers.client import LocalFile, PeerAbandonedError, PeerClient, PeerError
from ckptd.peers.frames import Request, read_tag
from ckptd.peers.liveness import REPLACED_WITHIN_SECONDS
from ckptd.peers.model import chunk_spans
from ckptd.peers.stream_client import StreamReader, connect
from ckptd.peers.stream_io import read_answer
from ckptd.runtime.clock import SYSTEM_CLOCK
from tests.support.fakes import wait_until
from tests.support.peers import TOKEN, Holder, header, push, write_part
from tests.support.streamproxy import StreamProxy

MiB = 1024 * 1024
SIZES = {"model.distcp": 20 * MiB + 123, "sub/rng.pt": 1000, "empty": 0}
SLACK = 1.5


@pytest.fixture
async def holder(tmp_path: Path) -> AsyncIterator[Holder]:
    held = await Holder(tmp_path / "replicas").start()
    yield held
    await held.stop()


@pytest.fixture
async def client() -> AsyncIterator[PeerClient]:
    c = PeerClient(TOKEN, SYSTEM_CLOCK)
    yield c
    await c.close()


def chunks_of(sizes: dict[str, int]) -> int:
    return sum(len(chunk_spans(n)) for n in sizes.values())


async def test_a_push_over_streams_is_held_byte_identical(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", SIZES)
    with StreamProxy(holder.address) as proxy:
        result = await push(client, proxy.address, files)
        assert proxy.streams >= 1
        assert proxy.chunks == chunks_of(SIZES)  # every chunk went over a stream
    assert holder.held_files(result.replica_id) == {f.path: f.local.read_bytes() for f in files}
    assert holder.incoming() == []


async def test_a_bit_flipped_in_a_chunk_is_refused_never_written_and_sent_again(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", SIZES)
    with StreamProxy(holder.address) as proxy:
        proxy.flip(1)
        result = await push(client, proxy.address, files)
        assert proxy.flipped == 1
        assert proxy.chunks == chunks_of(SIZES) + 1  # the damaged one, sent again
    assert holder.refused("corrupt") == 1
    assert holder.held_files(result.replica_id) == {f.path: f.local.read_bytes() for f in files}


async def test_a_link_that_damages_every_chunk_never_gets_a_part_acknowledged(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 3 * MiB})
    with StreamProxy(holder.address) as proxy:
        proxy.flip(1000)
        with pytest.raises(PeerError) as failed:
            await push(client, proxy.address, files)
        assert proxy.flipped == 5  # DAMAGED_SENDS, then the push gives up
        assert failed.value.reason == "corrupt"
        assert holder.store is not None and holder.store.held() == []
        await wait_until(lambda: holder.incoming() == [], 30.0, "the holder to drop the transfer")


async def test_a_connection_cut_mid_chunk_costs_that_chunk_only(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    sizes = {"big": 40 * MiB}
    files = write_part(tmp_path / "node", sizes)
    with StreamProxy(holder.address) as proxy:
        proxy.cut_next(2)
        result = await push(client, proxy.address, files)
        assert proxy.cut == 2
        assert proxy.chunks == chunks_of(sizes)  # each cut chunk arrived whole once, later
    assert holder.held_files(result.replica_id) == {"big": files[0].local.read_bytes()}


async def test_a_holder_gone_silent_mid_push_is_abandoned_within_the_bound(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 48 * MiB})
    with StreamProxy(holder.address) as proxy:

        async def silence() -> float:
            while proxy.chunks < 1:
                await asyncio.sleep(0.01)
            proxy.go_silent()
            return time.monotonic()

        silenced = asyncio.ensure_future(silence())
        with pytest.raises(PeerAbandonedError) as caught:
            await push(client, proxy.address, files, rate_mbit=100)
        gone_after = time.monotonic() - await silenced
    assert caught.value.why in ("silent", "stalled"), caught.value
    assert gone_after <= REPLACED_WITHIN_SECONDS + SLACK, gone_after


async def test_a_holder_that_gets_a_notice_mid_push_refuses_its_chunks_and_is_abandoned(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 48 * MiB})
    with StreamProxy(holder.address) as proxy:

        async def notice() -> float:
            while proxy.chunks < 1:
                await asyncio.sleep(0.01)
            holder.noticed = True
            return time.monotonic()

        noticed = asyncio.ensure_future(notice())
        with pytest.raises(PeerAbandonedError) as caught:
            await push(client, proxy.address, files, rate_mbit=100)
        after = time.monotonic() - await noticed
    assert caught.value.why == "notice"
    assert after <= 1.0 + SLACK, after  # the next chunk's 503, well before the push's end
    assert holder.store is not None and holder.store.held() == []


async def offered(client: PeerClient, holder: Holder, size: int) -> tuple[str, str]:
    """A transfer of one file of ``size`` offered to ``holder``: ``(transfer, its file)``."""
    local = LocalFile("f", Path("/dev/null"), size, 0)  # an offer names paths and sizes
    tid, streamed = await client._offer(holder.address, header(), [local], False)
    assert streamed
    return tid, str(holder.root / "incoming" / tid / "data" / "f")


def frame_put(target: str, body: bytes, token: bytes = TOKEN) -> tuple[bytes, str]:
    crc = checksum.to_hex(checksum.crc32c(body))
    signed, _ = auth.sign(token, "PUT", target, time.time(), auth.body_crc32c(crc))
    return Request("PUT", target, signed, len(body), crc32c=crc).encode() + body, signed


def exchange(address: str, frame: bytes) -> tuple[int, bool]:
    """Send ``frame`` on a fresh stream: ``(answer status, whether the holder kept the
    connection open)``."""
    sock = connect(address, 10)
    try:
        sock.sendall(frame)
        status = int(read_answer(sock)["status"])
        sock.settimeout(0.5)
        try:
            kept = sock.recv(1) != b""
        except TimeoutError:
            kept = True
        except ConnectionResetError:
            kept = False
        return status, kept
    finally:
        sock.close()


async def test_unsigned_badly_signed_and_replayed_frames_are_refused_and_write_nothing(
    holder: Holder, client: PeerClient
) -> None:
    tid, path = await offered(client, holder, 4096)
    target = f"/v1/peer/transfers/{tid}/files/0/0"
    body = os.urandom(4096)
    good, _ = frame_put(target, body)
    stranger, _ = frame_put(target, body, b"not-the-cluster-token-0123456789")
    unsigned = (
        Request(
            "PUT", target, "", len(body), crc32c=checksum.to_hex(checksum.crc32c(body))
        ).encode()
        + body
    )
    for frame in (unsigned, stranger):
        assert await asyncio.to_thread(exchange, holder.address, frame) == (401, False)
    assert os.path.getsize(path) == 0
    assert holder.store is not None
    assert await asyncio.to_thread(exchange, holder.address, good) == (200, True)
    with open(path, "rb") as f:
        assert f.read() == body
    # The same frame again, on a new connection: a replay, refused before its body.
    assert await asyncio.to_thread(exchange, holder.address, good) == (401, False)
    assert holder.refused("unauthorized") == 3


async def test_a_frame_whose_target_climbs_out_is_refused_and_writes_nothing(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    tid, path = await offered(client, holder, 4096)
    for target in (
        f"/v1/peer/transfers/{tid}/files/0/../../../../x",
        f"/v1/peer/transfers/../{tid}/files/0/0",
        "/v1/peer/transfers/%2e%2e/files/0/0",
    ):
        frame, _ = frame_put(target, b"x" * 4096)
        assert (await asyncio.to_thread(exchange, holder.address, frame))[0] == 400
    assert os.path.getsize(path) == 0
    assert not (tmp_path / "x").exists() and not (holder.root / "x").exists()


async def test_a_read_over_a_stream_is_the_held_files_bytes_and_needs_the_token(
    tmp_path: Path, holder: Holder, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 9 * MiB + 5})
    result = await push(client, holder, files)
    want = files[0].local.read_bytes()
    got = bytearray(len(want))

    def sink(pos: int, piece: memoryview) -> None:
        got[pos : pos + len(piece)] = piece

    reader = StreamReader(TOKEN, SYSTEM_CLOCK)
    await asyncio.to_thread(
        reader.read_range, holder.address, result.replica_id, 0, 0, len(want), sink
    )
    assert bytes(got) == want
    part = bytearray(100)
    await asyncio.to_thread(
        reader.read_range,
        holder.address,
        result.replica_id,
        0,
        8 * MiB - 50,
        100,
        lambda pos, piece: part.__setitem__(slice(pos, pos + len(piece)), piece),
    )
    assert bytes(part) == want[8 * MiB - 50 : 8 * MiB + 50]
    with pytest.raises(PeerError):  # past the file's end
        await asyncio.to_thread(
            reader.read_range, holder.address, result.replica_id, 0, len(want) - 1, 2, sink
        )
    stranger = StreamReader(b"not-the-cluster-token-0123456789", SYSTEM_CLOCK)
    with pytest.raises(PeerError) as refused:
        await asyncio.to_thread(
            stranger.read_range, holder.address, result.replica_id, 0, 0, 10, sink
        )
    assert "401" in str(refused.value)
    # The range is under the signature: a signed head with another range is refused.
    target = f"/v1/peer/holdings/{result.replica_id}/files/0"
    signed, _ = auth.sign(TOKEN, "GET", target, time.time(), read_tag(0, 10))
    forged = Request("GET", target, signed, 20, start=0).encode()
    assert (await asyncio.to_thread(exchange, holder.address, forged))[0] == 401


def test_the_frame_head_is_json_after_its_length() -> None:
    head = Request("GET", "/v1/peer/holdings/h/files/0", "a", 5, start=7).encode()
    n = int.from_bytes(head[:4], "big")
    assert json.loads(head[4 : 4 + n]) == {
        "method": "GET",
        "target": "/v1/peer/holdings/h/files/0",
        "authorization": "a",
        "length": 5,
        "start": 7,
    }
    assert len(head) == 4 + n
    assert Request.decode(head[4:]) == Request(
        "GET", "/v1/peer/holdings/h/files/0", "a", 5, start=7
    )


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
async def test_a_holder_on_a_filesystem_without_o_direct_holds_the_part_all_the_same(
    tmp_path: Path, client: PeerClient
) -> None:
    files = write_part(tmp_path / "node", {"model.distcp": 16 * MiB + 10, "rng.pt": 8 * MiB})
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        held = await Holder(Path(shm) / "replicas").start()
        try:
            result = await push(client, held, files)
            assert held.held_files(result.replica_id) == {
                f.path: f.local.read_bytes() for f in files
            }
        finally:
            await held.stop()
