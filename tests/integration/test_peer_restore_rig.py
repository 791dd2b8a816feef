"""No peer answering costs a restore at most the grace, however the peers went: on the
namespace rig, every announced peer's host is gone (its link down: a connect fails after
~3 s, no ARP answer) or drops every packet (a connect waits for its own timeout;
``../shared/facts/netns-test-hosts.md``). The restore is the store's, every byte as
committed, and done while the dropping peers are still being asked.

The test process is the restoring node (it sits on the rig's bridge); the store is a
``file://`` destination. How long it took is printed, not asserted (``bench/
bench_no_peer.py`` measures it).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ckptd.peers.source import credited, peers_tier
from ckptd.runtime.logs import get_logger
from ckptd.store.restore import RestoreRequest
from ckptd.store.tiers import open_tiers, restore_from_tiers
from tests.integration.test_peer_restore import (
    NAME,
    SIZES,
    announce,
    commit_files,
    restored,
    settings_for,
)
from tests.support.netns import rig_or_skip
from tests.support.peers import write_part


@pytest.mark.parametrize("how", ["gone", "dropping"])
def test_with_every_peer_gone_or_dropping_the_store_restores_at_once(
    tmp_path: Path, how: str
) -> None:
    settings = settings_for(tmp_path, wait=30.0)
    files = write_part(tmp_path / "node" / NAME, SIZES, seed=7)
    data = {f.path: f.local.read_bytes() for f in files}
    commit_files(settings, data)
    with rig_or_skip() as rig:
        for rank in (1, 2):
            host = rig.add_host(f"peer{rank}")
            if how == "gone":
                rig.link(host, up=False)
            else:
                rig.silence(host)
            announce(settings, None, rank=rank, address=f"{host.address}:9465")
        tiers = open_tiers(settings)
        request = RestoreRequest("run", None, tmp_path / "to", progress=False, take_lease=False)
        started = time.monotonic()
        peers, slot = peers_tier(settings, tiers, "run", None, None, get_logger())
        assert peers is not None and peers.peers == 2
        done: Any = credited(
            restore_from_tiers([peers.tier, *tiers], replace(request, checkpoint=slot)), peers
        )
        took = time.monotonic() - started
        settled = peers.storage.answers.settled()
    print(f"restore with every peer {how}: {took:.2f} s")
    assert restored(tmp_path / "to") == data
    assert (done.tier, done.peer_bytes) == ("primary", 0)
    assert done.store_bytes == sum(len(b) for b in data.values())
    if how == "dropping":
        # Their asks wait up to restore_wait_seconds (30 s): the restore did not.
        assert not settled
