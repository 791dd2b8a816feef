"""One part on ``copies`` holders that are alive and without a notice: the pushes, and
the watch over the holders after them.

    place  ``copies`` pushes at once (``ckptd.peers.client.push``), to the best candidates
           (``ckptd.peers.placement``), asked again each time a slot opens: a node that
           got a notice meanwhile is left out, one that announced meanwhile is taken in;
           each node is pushed to at most once per part. A push that fails, or that its
           watch abandons (``ckptd.peers.liveness``: no answer, no chunk taken, or a
           notice), is logged when it happens (``peer_push_failed``,
           ``peer_push_abandoned``) and the next candidate starts at once. An
           acknowledgement counts only from a holder without a notice by then. It ends
           with ``copies`` counted, or no candidate left, or the deadline (every push
           still running then is logged as abandoned, and ended).
    keep   then, until the part is in the store (the caller cancels it): each holder is
           asked ``/v1/peer/hello`` every ``PROBE_SECONDS``; one that has a notice, or
           answered nothing for ``STALL_SECONDS``, is dropped (``peer_holder_dropped``),
           and ``place`` pushes to the next candidate, until the deadline.

The invariant: ``Part.held`` lists only holders that acknowledged this exact replica
(``client.push``), were without a notice when counted, and, while ``keep`` runs, have
answered within ``STALL_SECONDS`` and said of no notice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptd.peers.client import LocalFile, PeerAbandonedError, PeerClient, PeerError, PushResult
from ckptd.peers.liveness import CONNECT_SECONDS, PROBE_SECONDS, STALL_SECONDS
from ckptd.peers.model import PeerAnnouncement, Replica
from ckptd.peers.pacing import Pace
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics


@dataclass
class Held:
    """A holder that acknowledged the part."""

    target: PeerAnnouncement
    result: PushResult
    answered: float  # monotonic: its last answer (the acknowledgement, then each hello)


@dataclass
class Part:
    """One part to keep on its holders (module doc)."""

    header: Replica
    files: list[LocalFile]
    pace: Pace
    deadline: float  # monotonic
    copies: int
    entries: list[dict[str, Any]]  # one per push, as /v1/status shows them
    held: list[Held] = field(default_factory=list)
    tried: set[int] = field(default_factory=set)  # ranks pushed to

    @property
    def run(self) -> str:
        return self.header.run_id


class Copies:
    """Places parts and keeps them placed (module doc)."""

    def __init__(
        self,
        client: PeerClient,
        *,
        targets: Callable[[str, int], list[PeerAnnouncement]],
        noticed: Callable[[str, int], bool],
        digests: bool,
        on_bytes: Callable[[int], None],
        metrics: Metrics,
        clock: Clock,
        log: Any,
    ) -> None:
        self.client = client
        self.targets = targets  # (run, part bytes) -> candidates, best first, now
        self.noticed = noticed  # (run, rank) -> has that node a notice, as known now
        self.digests = digests
        self.on_bytes = on_bytes
        self.metrics = metrics
        self.clock = clock
        self.log = log

    # -- place ---------------------------------------------------------------------------

    async def place(self, part: Part) -> None:
        """Push until ``part.copies`` hold it, or the candidates or the time run out."""
        total = part.header.total_bytes or sum(f.size for f in part.files)
        running: dict[asyncio.Task[PushResult | None], PeerAnnouncement] = {}
        try:
            while True:
                if len(running) + len(part.held) < part.copies:
                    for target in self.targets(part.run, total):
                        if len(running) + len(part.held) >= part.copies:
                            break
                        if target.node_rank in part.tried:
                            continue
                        part.tried.add(target.node_rank)
                        running[asyncio.ensure_future(self._push(part, target))] = target
                if not running or len(part.held) >= part.copies:
                    return
                left = part.deadline - self.clock.monotonic()
                if left <= 0:
                    return
                done, _ = await asyncio.wait(
                    running, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    target = running.pop(task)
                    if (result := task.result()) is None:
                        continue
                    if self.noticed(part.run, target.node_rank):
                        self._entry(part, target)["outcome"] = "notice"
                        self.log.warning(
                            "peer_push_abandoned",
                            peer=target.address,
                            node=target.node_rank,
                            why="notice",
                            detail="acknowledged, but it has a notice: not counted",
                        )
                        continue
                    part.held.append(Held(target, result, self.clock.monotonic()))
        finally:
            for task, target in running.items():
                task.cancel()
                self._entry(part, target)["outcome"] = "abandoned"
                self.metrics.peer_pushes.labels(run=part.run, outcome="abandoned").inc()
                self.log.warning(
                    "peer_push_abandoned",
                    peer=target.address,
                    node=target.node_rank,
                    why="deadline" if self.clock.monotonic() >= part.deadline else "ended",
                )
            await asyncio.gather(*running, return_exceptions=True)

    def _entry(self, part: Part, target: PeerAnnouncement) -> dict[str, Any]:
        found: dict[str, Any] | None = next(
            (e for e in reversed(part.entries) if e.get("node") == target.node_rank), None
        )
        if found is None:
            found = {"address": target.address, "node": target.node_rank}
            part.entries.append(found)
        return found

    async def _push(self, part: Part, target: PeerAnnouncement) -> PushResult | None:
        entry: dict[str, Any] = {"address": target.address, "node": target.node_rank}
        part.entries.append(entry)
        run = part.run
        try:
            result = await self.client.push(
                target.address,
                part.header,
                part.files,
                pace=part.pace,
                deadline=part.deadline,
                digests=self.digests,
                on_bytes=self.on_bytes,
            )
        except PeerAbandonedError as exc:
            entry.update(outcome="abandoned", why=exc.why)
            self.metrics.peer_pushes.labels(run=run, outcome="abandoned").inc()
            self.log.warning(
                "peer_push_abandoned",
                peer=target.address,
                node=target.node_rank,
                why=exc.why,
                after_s=round(exc.after, 3),
                error=str(exc),
            )
            return None
        except PeerError as exc:
            entry["outcome"] = exc.reason
            self.metrics.peer_pushes.labels(run=run, outcome=exc.reason).inc()
            self.log.warning(
                "peer_push_failed", peer=target.address, node=target.node_rank, error=str(exc)
            )
            return None
        entry.update(outcome="acknowledged", replica=result.replica_id)
        self.metrics.peer_pushes.labels(run=run, outcome="acknowledged").inc()
        return result

    # -- keep ----------------------------------------------------------------------------

    async def keep(self, part: Part, on_change: Callable[[Part], None]) -> None:
        """Watch ``part``'s holders until cancelled (module doc); ``on_change`` after a
        holder was dropped and the part placed again (or not)."""
        while True:
            await asyncio.sleep(PROBE_SECONDS)
            answers = await asyncio.gather(*(self._ask(h) for h in part.held))
            now = self.clock.monotonic()
            dropped = []
            for held, notice in zip(list(part.held), answers, strict=True):
                why = (
                    "notice"
                    if notice or self.noticed(part.run, held.target.node_rank)
                    else ("silent" if now - held.answered > STALL_SECONDS else None)
                )
                if why is not None:
                    dropped.append((held, why))
            if not dropped:
                continue
            for held, why in dropped:
                part.held.remove(held)
                self._entry(part, held.target)["outcome"] = f"dropped:{why}"
                self.metrics.peer_pushes.labels(run=part.run, outcome="dropped").inc()
                self.log.warning(
                    "peer_holder_dropped",
                    peer=held.target.address,
                    node=held.target.node_rank,
                    why=why,
                    holders_left=len(part.held),
                )
            if self.clock.monotonic() < part.deadline:
                await self.place(part)
            on_change(part)

    async def _ask(self, held: Held) -> bool:
        """Ask one holder who it is: whether it said it has a notice (its last answer
        noted)."""
        try:
            doc = await self.client.hello(held.target.address, timeout=CONNECT_SECONDS)
        except PeerError:
            return False
        if doc.get("peer") != held.target.peer:
            return False  # someone else answers there now: not an answer of the holder
        held.answered = self.clock.monotonic()
        return doc.get("notice") is True


__all__ = ["Copies", "Held", "Part"]
