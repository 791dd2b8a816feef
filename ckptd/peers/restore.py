"""A restore with the peers' help: replicas on peers first, and the nodes restoring the same
checkpoint sharing it (``ckptd restore`` and ``ckptd exec`` both restore through here).

With ``[peers] enabled``: the ``peers`` tier (``ckptd.peers.source``: replicas and parts
other nodes hold) goes first when any fresh peer is announced, and the ``shared`` tier
(``ckptd.peers.sharing``) ahead of it when ``share_restores`` is on, reading through it.
Without peers this is ``restore_from_tiers`` itself. The result counts the bytes by
source: ``peer_bytes`` from other nodes, ``store_bytes`` out of the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ckptd.config import Settings
from ckptd.peers.sharing.session import start_sharing
from ckptd.peers.source import credited, peers_tier
from ckptd.store.restore.request import RestoreRequest
from ckptd.store.tiers import TierRestore, TierStore, restore_from_tiers


def restore_with_peers(
    settings: Settings, tiers: Sequence[TierStore], request: RestoreRequest, log: Any
) -> tuple[TierRestore, list[TierStore]]:
    """Restore ``request`` (module doc); returns the result and the tiers it went
    through (the ``peers`` and ``shared`` ones included: the result names its tier)."""
    used = list(tiers)
    if not settings.peers.enabled:
        return restore_from_tiers(used, request), used
    store_tier = used[0].name
    peers, slot = peers_tier(settings, used, request.run_id, request.checkpoint, request.part, log)
    if peers is not None:
        used = [peers.tier, *used]
        request = replace(request, checkpoint=slot)
    sharing = start_sharing(
        settings,
        used,
        request.run_id,
        request.checkpoint,
        request.part,
        request.target_dir,
        log,
    )
    if sharing is None:
        done = restore_from_tiers(used, request)
        return (credited(done, peers) if peers is not None else done), used
    used = sharing.tiers(used)
    serving = False  # whether the others may still need what this node verified
    try:
        done = restore_from_tiers(used, sharing.request(request))
        serving = not done.result.skipped  # a checkpoint found in place served nothing
    finally:
        sharing.finish(linger=serving)
    return sharing.credit(done, peers, store_tier), used


__all__ = ["restore_with_peers"]
