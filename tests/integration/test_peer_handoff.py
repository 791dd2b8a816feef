"""The hand-off: a dead origin's part, put in the store by the peer holding its verified
replica, into the origin's claimed slot, through the commit protocol; and the replicas it
must never send (damaged at rest, of a save no longer announced) or never needs to (an
origin still alive).

The store is a ``file://`` destination set up as a two-node save leaves it when node 0
dies before its part: node 0's announcement and the slot's claim (``cluster-2``), node 1's
objects and part. The holder is node 1; node 0's replica reaches it through the real push.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.commit import objects
from ckptd.commit.assemble import Committer
from ckptd.commit.parts import Announcement, Part, part_files
from ckptd.commit.slots import Claim
from ckptd.core import checksum
from ckptd.devtools.locals3 import free_port
from ckptd.peers.client import PeerClient
from ckptd.repository import Repository, claim_key, object_key
from ckptd.runtime.clock import SYSTEM_CLOCK
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_storage
from ckptd.sync.handoff import HandOff
from ckptd.sync.journal import Journal
from ckptd.sync.transfer import Transfers
from tests.support.peers import TOKEN, Holder, push, write_part

MiB = 1024 * 1024
NAME = "step-10"
SAVE = "5a5e0001"


def leave_a_save_half_done(repo: Repository, node1: dict[str, bytes], save: str = SAVE) -> None:
    """Node 0 announced and claimed; node 1 shipped its files and wrote its part."""
    objects.write_announcement(
        repo,
        Announcement(
            run_id="run",
            checkpoint=NAME,
            save=save,
            node_rank=0,
            layout="dcp",
            step=10,
            announced_at="2026-12-06T12:00:00Z",
            writer="cluster-2",
        ),
    )
    claim = Claim(
        run_id="run",
        checkpoint=NAME,
        name=NAME,
        writer="cluster-2",
        host="node-0",
        claimed_at="2026-12-06T12:00:00Z",
        trajectory="",
        canonical=NAME,
        node_rank=0,
    )
    repo.put_if_absent(claim_key("run", NAME), claim.to_bytes(), "claim")
    entries = []
    for rel, data in node1.items():
        crc = checksum.crc32c(data)
        repo.storage.put_bytes(object_key("run", NAME, rel), data, crc32c=crc)
        entries.append((rel, len(data), checksum.to_hex(crc)))
    objects.write_part(
        repo,
        Part(
            run_id="run",
            checkpoint=NAME,
            node_rank=1,
            nodes=2,
            save=SAVE,
            layout="dcp",
            step=10,
            host="node-1",
            created_at="2026-12-06T12:00:00Z",
            verified_at="2026-12-06T12:00:05Z",
            total_bytes=sum(len(b) for b in node1.values()),
            files=part_files(entries, {}),
        ),
        NAME,
    )


async def make_scene(tmp_path: Path, origin: str) -> dict[str, Any]:
    """The half-done save in the store, and node 1 holding node 0's replica, whose peer
    port is ``origin``; ``close`` in the dict ends it all."""
    storage = open_storage(f"file://{tmp_path / 'store'}")
    repo = Repository(storage)
    node1 = {"__1_0.distcp": os.urandom(3 * MiB)}
    leave_a_save_half_done(repo, node1)
    files = write_part(tmp_path / "node-0" / NAME, {"__0_0.distcp": 5 * MiB + 3, ".metadata": 700})
    holder = await Holder(tmp_path / "replicas").start()
    client = PeerClient(TOKEN, SYSTEM_CLOCK)
    result = await push(
        client, holder, files, name=NAME, save=SAVE, address=origin, writer="cluster-2"
    )
    journal = Journal(tmp_path / "handoff")
    transfers = Transfers(storage, journal, part_size=8 * MiB, concurrency=2)
    metrics = Metrics()
    assert holder.store is not None
    handoff = HandOff(
        holder.store,
        client,
        repo,
        transfers,
        Committer(2, 1, "node-1"),
        after_seconds=0.5,
        keys=None,
        metrics=metrics,
        clock=SYSTEM_CLOCK,
        log=get_logger(),
    )

    async def close() -> None:
        await handoff.close()
        await client.close()
        transfers.close()
        journal.close()
        await holder.stop()

    return {
        "repo": repo,
        "holder": holder,
        "handoff": handoff,
        "files": files,
        "node1": node1,
        "rid": result.replica_id,
        "metrics": metrics,
        "close": close,
    }


@pytest.fixture
async def scene(tmp_path: Path) -> Any:
    """Node 0 is dead: nothing answers at its peer port."""
    found = await make_scene(tmp_path, f"127.0.0.1:{free_port()}")
    yield found
    await found["close"]()


async def tick_until(handoff: HandOff, done: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {handoff.done}"
        await handoff.tick()
        await asyncio.sleep(0.2)


def handoffs(metrics: Metrics, outcome: str) -> float:
    return metrics.peer_handoffs.labels(run="run", outcome=outcome)._value.get()


async def test_a_dead_origins_part_is_handed_off_into_its_slot_and_the_checkpoint_commits(
    scene: Any,
) -> None:
    repo: Repository = scene["repo"]
    await tick_until(
        scene["handoff"], lambda: repo.read_manifest("run", NAME) is not None, "the commit"
    )
    manifest = repo.read_manifest("run", NAME)
    assert manifest is not None and manifest.nodes == 2 and manifest.save == SAVE
    expected = {**{f.path: f.local.read_bytes() for f in scene["files"]}, **scene["node1"]}
    assert {f.path for f in manifest.files} == set(expected)
    for rel, data in expected.items():  # read back: byte-identical
        assert repo.storage.get_bytes(object_key("run", NAME, rel)) == data
    part0 = objects.read_part(repo, "run", NAME, 0)
    assert part0 is not None and part0.save == SAVE and part0.host == "node-0"
    assert handoffs(scene["metrics"], "committed") == 1
    held = scene["holder"].store.get(scene["rid"])
    assert held is not None and held.handed_off


async def test_a_replica_damaged_at_rest_is_refused_removed_and_never_sent(scene: Any) -> None:
    holder: Holder = scene["holder"]
    damaged = holder.root / "held" / scene["rid"] / "data" / "__0_0.distcp"
    with open(damaged, "r+b") as fh:
        fh.seek(MiB)
        byte = fh.read(1)
        fh.seek(MiB)
        fh.write(bytes([byte[0] ^ 1]))
    await tick_until(
        scene["handoff"], lambda: handoffs(scene["metrics"], "refused") == 1, "the refusal"
    )
    repo: Repository = scene["repo"]
    assert repo.storage.head(object_key("run", NAME, "__0_0.distcp")) is None
    assert objects.read_part(repo, "run", NAME, 0) is None
    assert repo.read_manifest("run", NAME) is None
    assert not (holder.root / "held" / scene["rid"]).exists()


async def test_a_replica_of_a_save_no_longer_announced_is_refused(scene: Any) -> None:
    repo: Repository = scene["repo"]
    announcement = objects.read_announcement(repo, "run", NAME)
    assert announcement is not None
    # Node 0 came back and re-saved under the same name: another save is announced.
    objects.write_announcement(repo, announcement.model_copy(update={"save": "5a5e0002"}))
    await tick_until(
        scene["handoff"], lambda: handoffs(scene["metrics"], "refused") == 1, "the refusal"
    )
    assert repo.storage.head(object_key("run", NAME, "__0_0.distcp")) is None
    assert objects.read_part(repo, "run", NAME, 0) is None


async def test_an_origin_that_still_answers_is_left_to_finish(tmp_path: Path) -> None:
    origin = await Holder(tmp_path / "origin", peer_id="peer-0").start()  # node 0, alive
    found = await make_scene(tmp_path, origin.address)
    try:
        for _ in range(8):
            await found["handoff"].tick()
            await asyncio.sleep(0.2)
        assert found["handoff"].done == []
        assert objects.read_part(found["repo"], "run", NAME, 0) is None
        # Gone (its port closed): now it is handed off.
        await origin.stop()
        await tick_until(
            found["handoff"],
            lambda: objects.read_part(found["repo"], "run", NAME, 0) is not None,
            "the hand-off once the origin is gone",
        )
    finally:
        await found["close"]()
        await origin.stop()
