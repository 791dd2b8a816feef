"""Peer replication in the daemon: built with it, started after the journal's recovery
(its periodic work then runs in its own task), stopped before the stores close
(``[peers] enabled``).

    build     the token read (exit 2 naming ``peers.token_file`` when it cannot be), the
              replica directory, this node's own parts, the peer port, the client,
              discovery through the store, the replicator (the pipeline's ``on_claimed``
              and ``on_stored`` hooks) and the hand-off (its own journal under
              ``<state dir>/peers/handoff``); nothing runs, nothing is opened
    start     the replica directory opened (what a restart left incoming dropped), the
              port listening, the address others reach this node at settled
              (``peers.advertise``, else the listen address, else this node's address on
              its route to the store: exit 2 naming ``peers.advertise`` when there is
              none), the failure domain (the setting, else the cloud's metadata), the
              first announcement; then the periodic work's task:
              announcements every ``announce_interval_seconds``, hand-offs every
              ``ckptd.sync.handoff.TICK_SECONDS``, idle transfers expired
    notice    a notice of this node's own (``noticed``; the daemon's build hands it every
              notice it publishes to the run's NOTICE): until its deadline this node
              holds no other node's part (its peer port refuses offers, chunks and seals
              with 503 ``notice``, its hello says ``"notice": true``) and its
              announcement says so, written again at once (``notice_until``)
    stop      the periodic work cancelled, the port closed, pushes and hand-offs cancelled, the directory closed

``status`` is ``/v1/status``'s ``peers`` (docs/design.md, "Peer replication").
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ckptd.commit.assemble import Committer
from ckptd.config import Settings
from ckptd.config.base import parse_listen
from ckptd.config.errors import ConfigError
from ckptd.config.peers import read_peer_token
from ckptd.notices.model import Notice
from ckptd.notices.zone import failure_domain
from ckptd.peers.client import PeerClient
from ckptd.peers.discovery import Discovery, advertised_address
from ckptd.peers.liveness import UNBOUNDED_NOTICE_SECONDS
from ckptd.peers.model import PeerAnnouncement
from ckptd.peers.own import OwnParts
from ckptd.peers.placement import under_notice
from ckptd.peers.replicas import ReplicaStore
from ckptd.peers.server import PeerServer
from ckptd.repository import Repository
from ckptd.runtime.clock import Clock
from ckptd.runtime.environment import describe
from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import Storage
from ckptd.sync.claims import cluster_writer
from ckptd.sync.handoff import TICK_SECONDS as HANDOFF_TICK_SECONDS
from ckptd.sync.handoff import HandOff
from ckptd.sync.journal import Journal
from ckptd.sync.replicate import Identity, Replicator
from ckptd.sync.transfer import Transfers

#: Idle transfers are expired, and the held replicas' gauges refreshed, this often.
HOUSEKEEPING_SECONDS = 30.0


class Peering:
    """This daemon's peer replication (module doc)."""

    def __init__(
        self,
        settings: Settings,
        storage: Storage,
        peer_id: str,
        metrics: Metrics,
        clock: Clock,
        log: Any,
    ) -> None:
        peers = settings.peers
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.log = log.bind(component="peers")
        self.peer_id = peer_id
        self.incarnation = secrets.token_hex(8)
        self.host = socket.gethostname()
        self.address = ""
        self.domain = peers.failure_domain
        self._periodic: asyncio.Task[None] | None = None  # from start to stop
        self.started_at = clock.time()
        self.notice_until: float | None = None  # Unix time: this node's own notice ends
        self._announcing: set[asyncio.Task[None]] = set()
        self.token = token = read_peer_token(peers)
        state_dir = Path(settings.state.dir)
        self.store = ReplicaStore(peers.replica_dir(state_dir), peers.quota_bytes, self.log)
        self.own = OwnParts()
        self.client = PeerClient(token, clock)
        self.server = self._peer_server(token)
        repo = Repository(storage)
        runs = [w.effective_run_id for w in settings.watch]
        self.discovery = Discovery(
            repo, runs, self.announcement, peers.announce_interval_seconds, clock, self.log
        )
        self.replicator = self._replicator()
        self.journal = Journal(state_dir / "peers" / "handoff")
        self.transfers = self._transfers(storage)
        self.handoff = self._handoff(repo)

    def _peer_server(self, token: bytes) -> PeerServer:
        """The peer port's server: it holds other nodes' parts in the replica directory,
        serves this node's own, and refuses to hold any while this node is under notice."""
        return PeerServer(
            self.store,
            self.own,
            token,
            self.metrics,
            self.clock,
            self.log,
            hello=self.hello,
            notice=self.under_notice,
        )

    def _replicator(self) -> Replicator:
        """The replicator behind the pipeline's ``on_claimed`` and ``on_stored`` hooks: it
        pushes this node's parts to the peers discovery finds, as this node (its job's
        writer, rank and host; the address and failure domain read when used, as start
        settles them)."""
        cluster = self.settings.cluster
        return Replicator(
            self.settings,
            self.client,
            self.discovery,
            self.own,
            Identity(
                peer=self.peer_id,
                writer=cluster_writer(cluster),
                host=self.host,
                rank=cluster.rank,
                nodes=cluster.nodes,
                address=lambda: self.address,
                failure_domain=lambda: self.domain,
                environment=describe(),
            ),
            self.metrics,
            self.clock,
            self.log,
        )

    def _transfers(self, storage: Storage) -> Transfers:
        """The hand-off's uploads to ``storage``: parts and concurrency as the
        destination's, recorded in the hand-off journal, each file's digests read too when
        checkpoints are authenticated (a key ring is configured)."""
        dest = self.settings.destination
        return Transfers(
            storage,
            self.journal,
            part_size=dest.part_size_mib * 1024 * 1024,
            concurrency=dest.concurrency,
            digests=self.settings.authentication.key_ring() is not None,
        )

    def _handoff(self, repo: Repository) -> HandOff:
        """The hand-off (``ckptd.sync.handoff``): a dead node's part, held here as a
        replica, put in the store in that node's name and the global commit tried, as a
        node of this job (its writer, rank and host)."""
        cluster = self.settings.cluster
        return HandOff(
            self.store,
            self.client,
            repo,
            self.transfers,
            Committer(cluster.nodes, cluster.rank, self.host, describe(), cluster_writer(cluster)),
            after_seconds=self.settings.peers.handoff_after_seconds,
            keys=self.settings.authentication.key_ring(),
            metrics=self.metrics,
            clock=self.clock,
            log=self.log,
        )

    # -- what this node says of itself -----------------------------------------------------

    def hello(self) -> dict[str, Any]:
        return {
            "peer": self.peer_id,
            "incarnation": self.incarnation,
            "node_rank": self.settings.cluster.rank,
            "host": self.host,
            "address": self.address,
            "notice": self.under_notice(),
        }

    def under_notice(self) -> bool:
        """Whether this node has a notice of its own now (module doc, "notice")."""
        return self.notice_until is not None and self.clock.time() < self.notice_until

    def noticed(self, notice: Notice) -> None:
        """A notice of this node's own: it holds no other node's part until the notice's
        deadline (``UNBOUNDED_NOTICE_SECONDS`` without one), and says so in its
        announcement at once (in the background: the caller never waits on the store)."""
        now = self.clock.time()
        until = (
            notice.deadline.timestamp()
            if notice.deadline is not None
            else now + UNBOUNDED_NOTICE_SECONDS
        )
        self.notice_until = max(self.notice_until or 0.0, until)
        self.log.warning(
            "peer_holding_stopped",
            why="this node has a notice",
            source=notice.source,
            seconds=round(until - now, 3),
        )
        if self._periodic is None:
            return  # not started (run --once): nothing announced, nothing served
        task = asyncio.get_running_loop().create_task(self.discovery.announce_now())
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    def announcement(self, run: str) -> PeerAnnouncement:
        cluster = self.settings.cluster
        return PeerAnnouncement(
            run_id=run,
            node_rank=cluster.rank,
            nodes=cluster.nodes,
            peer=self.peer_id,
            incarnation=self.incarnation,
            host=self.host,
            address=self.address,
            failure_domain=self.domain,
            quota_bytes=self.store.quota_bytes,
            free_bytes=self.store.free_bytes() if self.store.is_open else 0,
            updated_at=self.clock.time(),
            notice_until=self.notice_until if self.under_notice() else None,
            started_at=self.started_at,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self.store.open)
        host, port = parse_listen(self.settings.peers.listen)
        try:
            bound = await self.server.start(host, port)
        except OSError as exc:
            raise ConfigError(
                "peers.listen",
                f"cannot listen on {self.settings.peers.listen}: {exc.strerror or exc} (another "
                "daemon on this node, or an address this node does not have)",
            ) from None
        self.address = await asyncio.to_thread(self._advertised, bound)
        if not self.domain:
            p = self.settings.preemption
            self.domain = await failure_domain(p.provider, p.endpoint)
        self.metrics.peer_quota_bytes.set(self.store.quota_bytes)
        self.server.export_held()
        self.log.info(
            "peers_listening",
            listen=f"{host}:{bound}",
            address=self.address,
            failure_domain=self.domain or None,
            quota_bytes=self.store.quota_bytes,
            replicas=len(self.store.held()),
        )
        await self.discovery.once()
        await self._housekeep()
        self.replicator.active = True
        self._periodic = asyncio.create_task(self._run(), name="peers")

    def _advertised(self, bound: int) -> str:
        """``host:port`` the others reach this node at (module doc); ConfigError naming
        ``peers.advertise`` when this node cannot tell."""
        found = advertised_address(self.settings)
        if not found:
            raise ConfigError(
                "peers.advertise",
                f"this node's address for its peers is unknown ({self.settings.peers.listen} names none and "
                "no route to the store gives one): set peers.advertise to its cluster address",
            )
        host, _, port = found.rpartition(":")
        return f"{host}:{bound}" if port == "0" else found

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as group:
            interval = self.settings.peers.announce_interval_seconds
            group.create_task(self._every(interval, self.discovery.once, "announce"))
            group.create_task(self._every(HANDOFF_TICK_SECONDS, self.handoff.tick, "handoff"))
            group.create_task(self._every(HOUSEKEEPING_SECONDS, self._housekeep, "housekeeping"))

    async def _every(self, seconds: float, step: Callable[[], Awaitable[None]], what: str) -> None:
        """``step`` every ``seconds``, whatever one of them raised."""
        while True:
            await asyncio.sleep(seconds)
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - replication is never worth the daemon
                self.metrics.task_failures.labels(task=f"peers-{what}").inc()
                self.log.error("peers_step_failed", step=what, error=repr(exc))

    async def _housekeep(self) -> None:
        expired = await asyncio.to_thread(self.server.receiver.expire, self.clock.time())
        if expired:
            self.log.warning("peer_transfers_expired", transfers=expired)
        self.server.export_held()
        rank = self.settings.cluster.rank
        self.metrics.peers_known.set(
            len({a.node_rank for r in self.discovery.runs for a in self.discovery.fresh(r, rank)})
        )

    async def stop(self) -> None:
        self.replicator.active = False
        tasks = [*self._announcing, *([self._periodic] if self._periodic else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.server.stop()
        await self.replicator.close()
        await self.handoff.close()
        await self.client.close()
        await asyncio.to_thread(self.transfers.close)
        self.journal.close()
        self.store.close()

    # -- what it shows -------------------------------------------------------------------------

    def peer_addresses(self) -> list[str]:
        """The fresh announced peers' addresses, of every run (the health monitor's)."""
        rank = self.settings.cluster.rank
        return sorted(
            {a.address for run in self.discovery.runs for a in self.discovery.fresh(run, rank)}
        )

    def status(self) -> dict[str, Any]:
        """``/v1/status``'s ``peers``."""
        rank = self.settings.cluster.rank
        now = self.clock.time()
        held = self.store.held() if self.store.is_open else []
        return {
            "address": self.address,
            "failure_domain": self.domain,
            "notice": self.under_notice(),
            "known": [
                {
                    "run": a.run_id,
                    "node": a.node_rank,
                    "address": a.address,
                    "failure_domain": a.failure_domain,
                    "free_bytes": a.free_bytes,
                    "age_s": round(now - a.updated_at, 1),
                    "notice": under_notice(a, self.discovery.notices(run), now),
                }
                for run in self.discovery.runs
                for a in self.discovery.fresh(run, rank)
            ],
            "replicas": {
                "count": len(held),
                "bytes": sum(h.replica.total_bytes for h in held),
                "quota_bytes": self.store.quota_bytes,
                "free_bytes": self.store.free_bytes() if self.store.is_open else 0,
                "held": [
                    {
                        "run": h.replica.run_id,
                        "checkpoint": h.replica.name,
                        "node": h.replica.node_rank,
                        "bytes": h.replica.total_bytes,
                        "delivered": h.delivered,
                        "handed_off": h.handed_off,
                    }
                    for h in held[-8:]
                ],
            },
            "replication": self.replicator.status(),
            "handoffs": list(self.handoff.done),
        }


# The service's two calls (each a no-op without peer replication).


async def start_peering(peering: Peering | None, *, once: bool) -> None:
    """After the journal's recovery, before a notice can make a part need its peers;
    never under ``run --once`` (no port, no peers: everything goes to the store)."""
    if peering is not None and not once:
        await peering.start()


async def stop_peering(peering: Peering | None) -> None:
    if peering is not None:
        await peering.stop()


def own_notice_to_peers(
    publish: Callable[[Notice], asyncio.Task[bool]], peering: Peering
) -> Callable[[Notice], asyncio.Task[bool]]:
    """The responder's ``publish_notice`` (called for this node's own notices only, never
    for one followed from another node), telling ``peering`` first: a node with a notice
    holds no other node's part (module doc, "notice")."""

    def both(notice: Notice) -> asyncio.Task[bool]:
        peering.noticed(notice)
        return publish(notice)

    return both


__all__ = [
    "HOUSEKEEPING_SECONDS",
    "Peering",
    "own_notice_to_peers",
    "start_peering",
    "stop_peering",
]
