"""Peers find each other through the store: no list of addresses to configure.

Every ``announce_interval_seconds`` each daemon writes, for each run it watches,
``<run>/.ckptd-peers/node-<rank>.json`` (``ckptd.peers.model.PeerAnnouncement``: its peer
id, this start's incarnation, the address its peer port answers at, its failure domain,
its quota and what is free of it), and reads everyone else's. An announcement that stops
being refreshed goes stale (``placement.stale_after``) and is left out; a
replacement node, whatever its address or rank, is found from its first write. The
announcements are hints: a holder is trusted with nothing because it announced itself
(every request is signed with the cluster's token, every byte checked).

Notices: a node with a notice of its own says so in its announcement (``notice_until``,
written at once, ``announce``), and each read also reads the run's ``NOTICE``
(``placement.notice_mark``): placement never gives a part to a node under notice. An
emergency push reads both again first when they are older than ``FRESH_SECONDS``
(``refresh``), so a notice seen by another node a moment ago is known to the push.

Cost per interval and node: one PUT per run, one LIST, one GET per other node and one
GET of the run's NOTICE; once more at each emergency push.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ckptd.config import Settings
from ckptd.config.base import parse_listen
from ckptd.peers.model import PeerAnnouncement, parse_peer_announcement
from ckptd.peers.placement import NoticeMark, notice_mark, stale_after
from ckptd.repository import Repository, peer_key
from ckptd.runtime.clock import Clock
from ckptd.storage.base import StorageError

#: A peer announcement is a few hundred bytes; a larger object there is not one (unread).
ANNOUNCEMENT_MAX_BYTES = 64 * 1024
#: An emergency push reads the announcements and NOTICE again when older than this...
FRESH_SECONDS = 1.0
#: ...waiting this long at most for them (else it places by what it knew).
REFRESH_WAIT_SECONDS = 2.0


def write_announcement(repo: Repository, announcement: PeerAnnouncement) -> None:
    """Write (overwrite) a node's announcement at its key (``ckptd.repository.peer_key``)."""
    key = peer_key(announcement.run_id, announcement.node_rank)
    repo.put_json(key, announcement.to_bytes())


def read_announcements(repo: Repository, run: str) -> list[PeerAnnouncement]:
    """Every node's announcement under ``run``; one that does not parse, is too large, or
    names another run is left out (never trusted)."""
    found = []
    for info in repo.storage.list_objects(peer_key(run)):
        body = repo.get_or_none(info.key) if info.size <= ANNOUNCEMENT_MAX_BYTES else None
        announcement = parse_peer_announcement(body) if body is not None else None
        if announcement is not None and announcement.run_id == run:
            found.append(announcement)
    return found


def advertised_address(settings: Settings) -> str:
    """``host:port`` the other nodes reach this node's peer port at: ``[peers]
    advertise``, else the listen address when it names one, else this node's address on
    its route to the store (``route_address``); "" when it cannot tell."""
    peers = settings.peers
    listen_host, _ = parse_listen(peers.listen)
    route = ""
    if not peers.advertise and listen_host in ("0.0.0.0", "::"):
        endpoint = settings.destination.endpoint_url or "https://s3.amazonaws.com"
        route = route_address(urlsplit(endpoint).hostname or "")
    return peers.advertised(route)


def route_address(host: str) -> str:
    """This node's address on its route to ``host`` (no packet is sent: a UDP socket
    only picks its source address); "" when there is no route or no such host."""
    try:
        infos = socket.getaddrinfo(host, 443, type=socket.SOCK_DGRAM)
    except OSError:
        return ""
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(address)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return ""


@dataclass
class Discovery:
    """This node's announcements and the others' (module doc)."""

    repo: Repository
    runs: list[str]
    me: Callable[[str], PeerAnnouncement]  # this node's announcement for a run, now
    interval: float
    clock: Clock
    log: Any
    _known: dict[str, list[PeerAnnouncement]] = field(default_factory=dict)
    _notices: dict[str, dict[int, NoticeMark]] = field(default_factory=dict)
    _read_at: float | None = None
    _reading: asyncio.Task[None] | None = None

    @property
    def stale_after(self) -> float:
        return stale_after(self.interval)

    def announce(self) -> None:
        """Write this node's announcement under every run (blocking)."""
        for run in self.runs:
            write_announcement(self.repo, self.me(run))

    def read(self) -> None:
        """Read every node's announcement, and the NOTICE, under every run (blocking); an
        announcement that does not parse, or names another run, is left out."""
        known = {run: read_announcements(self.repo, run) for run in self.runs}
        notices: dict[str, dict[int, NoticeMark]] = {}
        for run in self.runs:
            mark = notice_mark(self.repo.read_notice(run))
            notices[run] = {mark.rank: mark} if mark is not None else {}
        # Marks once seen stay until their deadline: NOTICE is one object, and a second
        # node's notice overwrites the first's there.
        now = self.clock.time()
        for run, marks in self._notices.items():
            for rank, mark in marks.items():
                if mark.until > now:
                    notices.setdefault(run, {}).setdefault(rank, mark)
        self._known, self._notices = known, notices
        self._read_at = self.clock.monotonic()

    def notices(self, run: str) -> dict[int, NoticeMark]:
        """The nodes the run's NOTICE named, in force or not (placement judges)."""
        return dict(self._notices.get(run, {}))

    def known(self, run: str) -> list[PeerAnnouncement]:
        """The announcements last read for ``run`` (stale ones included: placement drops
        them against the time it is given)."""
        return list(self._known.get(run, []))

    def fresh(self, run: str, own_rank: int) -> list[PeerAnnouncement]:
        now = self.clock.time()
        return [
            a
            for a in self.known(run)
            if a.node_rank != own_rank and now - a.updated_at <= self.stale_after
        ]

    async def once(self) -> None:
        """Announce, then read; a store error is logged and the next round tries again."""
        try:
            await asyncio.to_thread(self.announce)
            await asyncio.to_thread(self.read)
        except StorageError as exc:
            self.log.warning("peer_announcement_failed", error=str(exc))

    async def announce_now(self) -> None:
        """Announce at once (this node's notice); a store error is logged."""
        try:
            await asyncio.to_thread(self.announce)
        except StorageError as exc:
            self.log.warning("peer_announcement_failed", error=str(exc))

    async def refresh(self) -> None:
        """Read again if the last read is older than ``FRESH_SECONDS``, waiting at most
        ``REFRESH_WAIT_SECONDS`` (one read at a time; a slow one goes on behind)."""
        if self._read_at is not None and self.clock.monotonic() - self._read_at < FRESH_SECONDS:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.get_running_loop().create_task(self._read_logged())
        await asyncio.wait({self._reading}, timeout=REFRESH_WAIT_SECONDS)

    async def _read_logged(self) -> None:
        try:
            await asyncio.to_thread(self.read)
        except StorageError as exc:
            self.log.warning("peer_announcements_not_read", error=str(exc))


__all__ = [
    "ANNOUNCEMENT_MAX_BYTES",
    "FRESH_SECONDS",
    "REFRESH_WAIT_SECONDS",
    "Discovery",
    "advertised_address",
    "read_announcements",
    "route_address",
    "write_announcement",
]
