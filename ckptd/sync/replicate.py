"""This node's part of a checkpoint, pushed to its peers beside its upload to the store.

Once a checkpoint's slot is claimed (step 0 of the commit protocol; with many nodes, the
announced save's slot) and before its first object goes to the store, the pipeline
hands the request here (``PipelineHooks.on_claimed``). An emergency checkpoint (one
completed during a notice) is always pushed; a routine one when ``[peers] periodic``.
The push runs beside the store upload:

- the peers are chosen by ``ckptd.peers.placement`` from the announcements
  ``ckptd.peers.discovery`` read (another failure domain first; never a node under
  notice: an emergency push reads the announcements and the run's NOTICE again first);
  the part goes to the first ``copies`` that acknowledge it, the next in line taking
  over from one that refuses, fails, stops answering or gets a notice
  (``ckptd.peers.copies``, within ``ckptd.peers.liveness``'s bounds);
- emergency pushes go at ``emergency_rate_mbit`` until the notice's deadline, routine
  ones at ``rate_mbit`` (``ckptd.peers.pacing``);
- an emergency part goes to its peers first and to the store after (the store upload
  awaits ``_first``; its files are not shipped early, ``ckptd.sync.early``): the store
  cannot take it within the notice anyway, and the two sharing the node's link and cores
  would slow the push by the upload's share; a push that stalls for ``STALLED_SECONDS``
  lets the store go;
- once ``copies`` peers acknowledged the replica, verified and fsynced
  (``ckptd.peers.client.push``), the checkpoint is **safe off the node**: ``on_safe``
  tells the responder (whichever of this and the store's commit comes first is what an
  emergency response reports), and the part is listed as one this node serves from its
  own files to a restore elsewhere (``ckptd.peers.own``);
- until this node's part is in the store its holders are watched
  (``ckptd.peers.copies``, ``keep``): one that gets a notice or stops answering is
  dropped and the next candidate takes the part;
- once this node's part is in the store (``stored``) its holders are told: a replica
  whose origin delivered is never handed off (``ckptd.sync.handoff``).

A push never fails the checkpoint: the store upload goes on whatever happens here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ckptd.commit.parts import save_id
from ckptd.config import Settings
from ckptd.core import digest
from ckptd.core.manifest import utc_timestamp
from ckptd.layouts.base import step_of
from ckptd.peers.client import LocalFile, PeerClient
from ckptd.peers.copies import Copies, Part
from ckptd.peers.discovery import Discovery
from ckptd.peers.model import PeerAnnouncement, Replica
from ckptd.peers.own import OwnParts
from ckptd.peers.pacing import Pace
from ckptd.peers.placement import candidates, under_notice
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics
from ckptd.sync.request import ShipRequest, local_path

#: A routine push, or an emergency one without a deadline, gives up after this long.
PUSH_SECONDS = 3600.0
#: An emergency push that sent nothing for this long no longer holds the store upload.
STALLED_SECONDS = 5.0

# (run, checkpoint, how it became safe: "peer" | "store", emergency, what to report)
SafeHook = Callable[[str, str, str, bool, dict[str, Any]], None]


@dataclass
class Identity:
    """Who this node is to its peers."""

    peer: str  # its journal's writer id
    writer: str  # the claims' writer (``cluster-<nodes>`` with many nodes)
    host: str
    rank: int
    nodes: int
    address: Callable[[], str]  # its advertised peer address (known once it listens)
    failure_domain: Callable[[], str]
    environment: dict[str, str] = field(default_factory=dict)


@dataclass
class Replication:
    """One checkpoint's push, as ``/v1/status`` shows it."""

    run: str
    checkpoint: str
    emergency: bool
    bytes: int
    started: float  # monotonic
    started_at: float  # wall clock
    peers: list[dict[str, Any]] = field(default_factory=list)
    acknowledged_after_s: float | None = None
    outcome: str = "pushing"  # pushing | safe | not_safe

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "emergency": self.emergency,
            "bytes": self.bytes,
            "started_at": utc_timestamp(self.started_at),
            "acknowledged_after_s": self.acknowledged_after_s,
            "outcome": self.outcome,
            "peers": self.peers,
        }


class Replicator:
    """Pushes this node's parts to its peers (module doc)."""

    def __init__(
        self,
        settings: Settings,
        client: PeerClient,
        discovery: Discovery,
        own: OwnParts,
        me: Identity,
        metrics: Metrics,
        clock: Clock,
        log: Any,
    ) -> None:
        self.peers = settings.peers
        self.digests = settings.authentication.key_ring() is not None
        self.client = client
        self.discovery = discovery
        self.own = own
        self.me = me
        self.metrics = metrics
        self.clock = clock
        self.log = log
        self.on_safe: SafeHook = lambda run, name, via, emergency, detail: None
        self.routine = Pace.of_mbit(self.peers.rate_mbit, clock.monotonic)
        self.emergency = Pace.of_mbit(self.peers.emergency_rate_mbit, clock.monotonic)
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._keepers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.copies = Copies(
            client,
            targets=self._targets,
            noticed=self._noticed,
            digests=self.digests,
            on_bytes=self._sent,
            metrics=metrics,
            clock=clock,
            log=log,
        )
        self._background: set[asyncio.Task[None]] = set()
        self._last: dict[str, Replication] = {}  # per run, the latest push
        self._held_by: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (address, replica)
        self._safe: dict[tuple[str, str], str] = {}  # the save each checkpoint is safe for
        self.active = False  # set once the peer port serves (never under `run --once`)
        self._progress = 0  # bytes any push has had taken, for ``_first``

    # -- the pipeline's hooks ----------------------------------------------------------------

    def claimed(
        self, request: ShipRequest, emergency: bool, seconds_left: float | None
    ) -> Awaitable[None] | None:
        """Step 0 is done for ``request``: push it if it is to be (module doc). For an
        emergency push, what the store upload awaits first (``first``)."""
        if not (emergency or self.peers.periodic) or request.slot is None:
            return None
        if not self.active:
            return None  # `run --once`: no peer port, no peers
        key = (request.run, request.name)
        running = self._tasks.get(key)
        if running is None or running.done():
            save = self._header(request, emergency).save
            if self._safe.get(key) == save:
                return None  # a retry of the store upload: this save is on its peers already
            limit = PUSH_SECONDS if seconds_left is None else max(1.0, seconds_left)
            running = asyncio.get_running_loop().create_task(
                self._replicate(request, emergency, self.clock.monotonic() + limit),
                name=f"replicate-{request.run}-{request.name}",
            )
            self._tasks[key] = running
            running.add_done_callback(
                lambda t: self._tasks.pop(key, None) if self._tasks.get(key) is t else None
            )
        return self._first(running) if emergency else None

    async def _first(self, push: asyncio.Task[None]) -> None:
        """An emergency part goes to its peers first, the store after: the store cannot
        take it within the notice anyway (that is why there are peers), and sharing the
        node's link and cores with the upload would slow the push by as much. Returns
        once the push ended (acknowledged, or failed), or made no progress for
        ``STALLED_SECONDS``: a stalled peer never holds the store back."""
        last, seen = self.clock.monotonic(), self._progress
        while not push.done():
            await asyncio.wait({push}, timeout=0.2)
            if self._progress != seen:
                last, seen = self.clock.monotonic(), self._progress
            elif self.clock.monotonic() - last > STALLED_SECONDS:
                self.log.warning("store_upload_not_held", why="the push to peers stalled")
                return

    def stored(self, run: str, name: str) -> None:
        """This node's part of ``run/name`` is in the store: its holders need not hand it
        off (told in the background, best effort), and are no longer watched."""
        keeper = self._keepers.pop((run, name), None)
        if keeper is not None:
            keeper.cancel()
        for address, rid in self._held_by.pop((run, name), []):
            task = asyncio.get_running_loop().create_task(self._tell_delivered(address, rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _tell_delivered(self, address: str, rid: str) -> None:
        try:
            await self.client.delivered(address, rid)
        except Exception as exc:  # noqa: BLE001 - a hint: the holder also asks the store
            self.log.info("peer_delivered_not_told", peer=address, replica=rid, error=repr(exc))

    # -- one push ------------------------------------------------------------------------

    def _header(self, request: ShipRequest, emergency: bool) -> Replica:
        assert request.slot is not None
        cluster = request.cluster
        listing = request.listing
        return Replica(
            run_id=request.run,
            checkpoint=request.slot.slot,
            name=request.name,
            save=cluster.save
            if cluster is not None
            else save_id((f.path, f.size, f.mtime_ns) for f in listing.files),
            node_rank=self.me.rank,
            nodes=self.me.nodes,
            step=step_of(request.name),
            layout=request.verdict.layout,
            writer=self.me.writer,
            host=self.me.host,
            peer=self.me.peer,
            address=self.me.address(),
            created_at=utc_timestamp(listing.newest_mtime_ns / 1e9),
            total_bytes=0,
            emergency=emergency,
            files=[],
            environment=self.me.environment,
            digest=digest.ALGORITHM if self.digests else None,
        )

    def _targets(self, run: str, part_bytes: int) -> list[PeerAnnouncement]:
        return candidates(
            self.discovery.known(run),
            rank=self.me.rank,
            peer=self.me.peer,
            failure_domain=self.me.failure_domain(),
            part_bytes=part_bytes,
            now=self.clock.time(),
            stale_after=self.discovery.stale_after,
            notices=self.discovery.notices(run),
        )

    def _noticed(self, run: str, rank: int) -> bool:
        """Whether node ``rank`` has a notice, by its newest announcement and the NOTICE."""
        mine = [a for a in self.discovery.known(run) if a.node_rank == rank]
        if not mine:
            return False
        newest = max(mine, key=lambda a: a.updated_at)
        return under_notice(newest, self.discovery.notices(run), self.clock.time())

    async def _replicate(self, request: ShipRequest, emergency: bool, deadline: float) -> None:
        run, name = request.run, request.name
        files = [
            LocalFile(f.path, local_path(request, f), f.size, f.mtime_ns)
            for f in request.listing.files
        ]
        total = sum(f.size for f in files)
        state = Replication(run, name, emergency, total, self.clock.monotonic(), self.clock.time())
        self._last[run] = state
        log = self.log.bind(run=run, checkpoint=name)
        if emergency:
            await self.discovery.refresh()  # a notice seen a moment ago elsewhere counts
        header = self._header(request, emergency)
        pace = self.emergency if emergency else self.routine
        part = Part(header, files, pace, deadline, self.peers.copies, state.peers)
        keeper = self._keepers.pop((run, name), None)
        if keeper is not None:
            keeper.cancel()  # an earlier save's holders: this one replaces them
        await self.copies.place(part)
        if len(part.held) < self.peers.copies:
            state.outcome = "not_safe"
            log.error(
                "checkpoint_not_safe_on_peers",
                acknowledged=len(part.held),
                copies=self.peers.copies,
                peers_tried=len(state.peers),
                peers_known=len(self.discovery.known(run)),
                peers_under_notice=sorted(
                    a.node_rank
                    for a in self.discovery.known(run)
                    if self._noticed(run, a.node_rank)
                ),
                why="too few peers alive and without a notice took the part: it is safe "
                "once the store has it",
            )
            return
        seconds = self.clock.monotonic() - state.started
        state.outcome, state.acknowledged_after_s = "safe", round(seconds, 3)
        self.metrics.peer_replication_seconds.labels(run=run).observe(seconds)
        first = part.held[0].result
        self.own.register(first.replica, request.dir, first.identities, self.clock.time())
        self._held_by[(run, name)] = [(h.target.address, h.result.replica_id) for h in part.held]
        self._safe[(run, name)] = header.save
        addresses = [h.target.address for h in part.held]
        log.info(
            "checkpoint_safe_on_peers",
            peers=addresses,
            bytes=total,
            seconds=round(seconds, 3),
            emergency=emergency,
        )
        self.on_safe(
            run, name, "peer", emergency, {"peers": addresses, "seconds": round(seconds, 3)}
        )
        task = asyncio.get_running_loop().create_task(
            self.copies.keep(part, lambda p: self._replaced(run, name, p, log)),
            name=f"keep-{run}-{name}",
        )
        self._keepers[(run, name)] = task
        task.add_done_callback(
            lambda t: (
                self._keepers.pop((run, name), None)
                if self._keepers.get((run, name)) is t
                else None
            )
        )

    def _replaced(self, run: str, name: str, part: Part, log: Any) -> None:
        """A holder of ``run/name`` was dropped (``Copies.keep``); ``part.held`` is what
        holds it now."""
        state = self._last.get(run)
        held = [(h.target.address, h.result.replica_id) for h in part.held]
        if (run, name) in self._held_by:
            self._held_by[(run, name)] = held
        if len(part.held) >= part.copies:
            log.info("checkpoint_safe_on_peers", peers=[a for a, _ in held], replaced=True)
            if state is not None and state.checkpoint == name:
                state.outcome = "safe"
            return
        log.error(
            "checkpoint_not_safe_on_peers",
            acknowledged=len(part.held),
            copies=part.copies,
            why="a holder was dropped and no other peer alive and without a notice took the "
            "part: it is safe once the store has it",
        )
        if state is not None and state.checkpoint == name:
            state.outcome = "not_safe"

    def _sent(self, n: int) -> None:
        self._progress += n
        self.metrics.peer_sent_bytes.inc(n)

    # -- what it shows -------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {run: r.to_json() for run, r in self._last.items()}

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._keepers.values(), *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["PUSH_SECONDS", "STALLED_SECONDS", "Identity", "Replication", "Replicator", "SafeHook"]
