"""A node cut off from every peer of its run is a health event (``peers-unreachable``), under
a real ``ckptd run`` with ``[peers]`` and ``[health]`` on: its one announced peer's port
answers nothing, so the event comes once ``unreachable_seconds`` passed; once a real peer
port answers at that address, the condition ends."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from ckptd.config import Settings
from ckptd.peers.discovery import write_announcement
from ckptd.peers.model import PeerAnnouncement
from ckptd.repository import Repository
from ckptd.runtime.clock import SYSTEM_CLOCK
from ckptd.store.tiers import open_tiers
from tests.support.daemon import Daemon, wait_until
from tests.support.peers import TOKEN, Holder, free_port


async def test_a_node_cut_off_from_every_peer_is_a_health_event_that_ends_when_one_answers(
    tmp_path: Path, s3_dest: str, local_s3: Any
) -> None:
    peer = Holder(tmp_path / "peer")  # announced; its port stays closed for now
    store = Settings(destination={"url": s3_dest, "endpoint_url": local_s3.endpoint_url})
    write_announcement(
        Repository(open_tiers(store)[0].storage),
        PeerAnnouncement(
            run_id="run",
            node_rank=1,
            nodes=2,
            peer="peer-1",
            incarnation="i",
            host="node-1",
            address=peer.address,
            quota_bytes=1 << 30,
            free_bytes=1 << 30,
            updated_at=SYSTEM_CLOCK.time(),
        ),
    )
    token = tmp_path / "cluster.token"
    token.write_bytes(TOKEN)
    (tmp_path / "run").mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": tmp_path / "run", "run_id": "run"}],
        dest=s3_dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=tmp_path / "state",
    )
    with daemon.config.open("a") as config:
        config.write(
            "[cluster]\nnodes = 2\nnode_rank = 0\n"
            f"[peers]\nenabled = true\ntoken_file = {json.dumps(str(token))}\n"
            f'quota_gib = 1\nlisten = "127.0.0.1:{free_port()}"\n'
            '[health]\nenabled = true\nunreachable_seconds = 2\nkmsg = ""\npsi = ""\n'
            'poll_interval_seconds = 0.5\non_degrading = "report"\n'
        )
    with daemon:
        wait_until(
            lambda: daemon.events_named("health_event", kind="peers-unreachable"),
            60,
            "the peers-unreachable event",
            details=daemon.log_text,
        )
        (event,) = daemon.events_named("health_event", kind="peers-unreachable")
        assert event.get("source") == "peers", event
        await peer.start()
        try:  # waited for in a thread: the peer port answers on this test's event loop
            await asyncio.to_thread(
                wait_until,
                lambda: daemon.events_named("health_condition_ended", kind="peers-unreachable"),
                60,
                "the condition's end once the peer answers",
                details=daemon.log_text,
            )
        finally:
            await peer.stop()
        # One outage, one event.
        assert len(daemon.events_named("health_event", kind="peers-unreachable")) == 1
