"""Which peers take a node's part: no static configuration, any node count from 2.

Pure: the announcements read from the store and the time are arguments.

The order, best first (``candidates``):

1. never this node itself (by rank or by peer id), nor an announcement older than
   ``stale_after`` (its daemon stopped refreshing it: gone, or cut off), nor a peer whose
   whole quota is smaller than the part, nor a node **under notice** (``under_notice``):
   one whose announcement says so (``notice_until`` still ahead), or one the run's
   ``NOTICE`` in the store names (``notice_mark``), until that notice's deadline. A node
   about to go is never given another's part: the replica would go with it;
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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ckptd.peers.liveness import UNBOUNDED_NOTICE_SECONDS
from ckptd.peers.model import PeerAnnouncement

#: An announcement not refreshed for this many refresh intervals names a gone daemon...
STALE_INTERVALS = 3
#: ...and never sooner than this: a node's announcements go to the store over the link
#: its store upload fills during an emergency, and may take that long to land.
STALE_MIN_SECONDS = 30.0


def stale_after(interval: float) -> float:
    """How old an announcement refreshed every ``interval`` seconds may be and count."""
    return max(STALE_INTERVALS * interval, STALE_MIN_SECONDS)


@dataclass(frozen=True)
class NoticeMark:
    """The run's ``NOTICE`` read as "node ``rank`` has a notice": noticed at
    ``noticed_at``, in force until ``until`` (Unix seconds)."""

    rank: int
    noticed_at: float
    until: float


def notice_mark(doc: Mapping[str, Any] | None) -> NoticeMark | None:
    """What a ``NOTICE`` document (``ckptd.notices.cluster.notice_document``) says of its
    node: in force until its deadline, or ``UNBOUNDED_NOTICE_SECONDS`` after it was
    noticed when it has none; None when it is no notice of a node."""
    if doc is None:
        return None
    try:
        rank = doc["node_rank"]
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            return None
        noticed = _unix(str(doc["noticed_at"]))
        deadline = doc.get("deadline")
        until = _unix(str(deadline)) if deadline else noticed + UNBOUNDED_NOTICE_SECONDS
    except (KeyError, ValueError, TypeError):
        return None
    return NoticeMark(rank, noticed, until)


def _unix(value: str) -> float:
    parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise ValueError(f"{value!r} names no time zone")
    return parsed.timestamp()


def under_notice(a: PeerAnnouncement, marks: Mapping[int, NoticeMark], now: float) -> bool:
    """Whether the node that announced ``a`` has a notice at ``now``: its announcement
    says so, or a ``NOTICE`` names its rank, in force, and noticed after that daemon
    started (a replacement that started after the notice, at the same rank, has none)."""
    if a.notice_until is not None and a.notice_until > now:
        return True
    mark = marks.get(a.node_rank)
    if mark is None or mark.until <= now:
        return False
    return a.started_at is None or a.started_at < mark.noticed_at


def candidates(
    announcements: Iterable[PeerAnnouncement],
    *,
    rank: int,
    peer: str,
    failure_domain: str,
    part_bytes: int,
    now: float,
    stale_after: float,
    notices: Mapping[int, NoticeMark] | None = None,
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
    # A rank's newest announcement decides: a zombie's old notice does not exclude the
    # replacement that announced after it.
    marks = notices or {}
    newest = {r: a for r, a in newest.items() if not under_notice(a, marks, now)}

    def key(a: PeerAnnouncement) -> tuple[int, int, int, str]:
        same_domain = bool(failure_domain) and a.failure_domain == failure_domain
        unknown = not failure_domain or not a.failure_domain
        domain_rank = 1 if unknown else (2 if same_domain else 0)
        fits = 0 if a.free_bytes >= part_bytes else 1
        distance = (a.node_rank - rank) % max(a.nodes, rank + 1, a.node_rank + 1)
        return (domain_rank, fits, distance, a.peer)

    return sorted(newest.values(), key=key)


__all__ = [
    "STALE_INTERVALS",
    "STALE_MIN_SECONDS",
    "NoticeMark",
    "candidates",
    "notice_mark",
    "stale_after",
    "under_notice",
]
