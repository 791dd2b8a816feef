"""Which peers take a node's part: no static configuration, any node count from 2.

Pure: the announcements read from the store and the time are arguments.

The order, best first (``candidates``):

1. never this node itself (by rank or by peer id), nor an announcement older than
   ``stale_after`` (its daemon stopped refreshing it: gone, or cut off), nor a peer whose
   whole quota is smaller than the part;
2. a peer in another failure domain first, where this node knows its own and theirs: a
   zone's outage (a spot reclaim often takes a zone's capacity at once) must not take a
   part and its replica together;
3. among those, one whose free quota holds the part without evicting (eviction takes the
   holder's oldest replica, which may be someone's only copy);
4. then by distance on the ring of ranks from this node's (rank + 1 first): with every
   node placing this way, each node's replicas spread over different holders, for any
   node count, odd included;
5. ties (two daemons announcing one rank: a zombie and its replacement) by the newer
   announcement.

The replicator takes the first ``copies`` that accept the offer and moves on down the
list when one refuses (a full quota, an offer it cannot take). A replacement node with a
new address or a new rank simply announces itself: nothing else needs to know.
"""

from __future__ import annotations

from collections.abc import Iterable

from ckptd.peers.model import PeerAnnouncement

#: An announcement not refreshed for this many refresh intervals names a gone daemon...
STALE_INTERVALS = 3
#: ...and never sooner than this: a node's announcements go to the store over the link
#: its store upload fills during an emergency, and may take that long to land.
STALE_MIN_SECONDS = 30.0


def stale_after(interval: float) -> float:
    """How old an announcement refreshed every ``interval`` seconds may be and count."""
    return max(STALE_INTERVALS * interval, STALE_MIN_SECONDS)


def candidates(
    announcements: Iterable[PeerAnnouncement],
    *,
    rank: int,
    peer: str,
    failure_domain: str,
    part_bytes: int,
    now: float,
    stale_after: float,
) -> list[PeerAnnouncement]:
    """The peers that may take a part of ``part_bytes`` from node ``rank``, best first
    (module doc)."""
    newest: dict[int, PeerAnnouncement] = {}
    for a in announcements:
        if a.node_rank == rank or a.peer == peer:
            continue
        if now - a.updated_at > stale_after or a.quota_bytes < part_bytes:
            continue
        held = newest.get(a.node_rank)
        if held is None or a.updated_at > held.updated_at:
            newest[a.node_rank] = a

    def key(a: PeerAnnouncement) -> tuple[int, int, int, str]:
        same_domain = bool(failure_domain) and a.failure_domain == failure_domain
        unknown = not failure_domain or not a.failure_domain
        domain_rank = 1 if unknown else (2 if same_domain else 0)
        fits = 0 if a.free_bytes >= part_bytes else 1
        distance = (a.node_rank - rank) % max(a.nodes, rank + 1, a.node_rank + 1)
        return (domain_rank, fits, distance, a.peer)

    return sorted(newest.values(), key=key)


__all__ = ["STALE_INTERVALS", "STALE_MIN_SECONDS", "candidates", "stale_after"]
