"""Peer replication in one process: a holder's peer port on loopback, parts to push.

``Holder`` is a real ``PeerServer`` over a real ``ReplicaStore`` in a temp dir, on a free
loopback port (restartable on the same port and dir, as a daemon restarting would be);
``write_part`` writes a node's files with random bytes and returns them as the client
lists them; ``header`` is the replica document a push starts from. Shared by
tests/integration/test_peer_*.py.
"""

from __future__ import annotations

import os
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import free_port
from ckptd.peers.client import LocalFile, PeerClient
from ckptd.peers.model import Replica
from ckptd.peers.own import OwnParts
from ckptd.peers.pacing import Pace
from ckptd.peers.replicas import ReplicaStore
from ckptd.peers.server import PeerServer
from ckptd.runtime.clock import SYSTEM_CLOCK
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics

TOKEN = b"0123456789abcdef0123456789abcdef"


@dataclass
class Holder:
    """One node's peer port (module doc)."""

    root: Path
    quota_bytes: int = 1 << 30
    token: bytes = TOKEN
    port: int = field(default_factory=free_port)
    peer_id: str = "holder"  # what it answers /v1/peer/hello with
    metrics: Metrics = field(default_factory=Metrics)
    store: ReplicaStore | None = None
    server: PeerServer | None = None
    own: OwnParts = field(default_factory=OwnParts)
    noticed: bool = False  # a notice of its own: it refuses parts (503) and says so

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Holder:
        log = get_logger()
        self.store = ReplicaStore(self.root, self.quota_bytes, log)
        self.store.open()
        self.server = PeerServer(
            self.store,
            self.own,
            self.token,
            self.metrics,
            SYSTEM_CLOCK,
            log,
            hello=lambda: {
                "peer": self.peer_id,
                "incarnation": secrets.token_hex(4),
                "notice": self.noticed,
            },
            notice=lambda: self.noticed,
        )
        await self.server.start("127.0.0.1", self.port)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def refused(self, reason: str) -> float:
        return self.metrics.peer_refused.labels(reason=reason)._value.get()

    def incoming(self) -> list[str]:
        """Every entry under the holder's incoming/ (parts being received). Walked with
        ``os.walk``, which skips what the holder removes meanwhile (``rglob`` raises)."""
        base = self.root / "incoming"
        return sorted(
            os.path.relpath(os.path.join(top, name), base)
            for top, dirs, files in os.walk(base)
            for name in (*dirs, *files)
        )

    def held_files(self, rid: str) -> dict[str, bytes]:
        base = self.root / "held" / rid / "data"
        return {
            p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()
        }


def write_part(base: Path, sizes: dict[str, int], seed: int = 0) -> list[LocalFile]:
    """Files under ``base`` with ``sizes`` random bytes each, as the client lists them."""
    rng = random.Random(seed)
    out = []
    for rel, size in sizes.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
        st = os.stat(path)
        out.append(LocalFile(rel, path, st.st_size, st.st_mtime_ns))
    return out


def header(name: str = "step-10", rank: int = 0, save: str = "0a1b2c3d", **extra: Any) -> Replica:
    """The replica document a push of node ``rank``'s part of ``name`` starts from."""
    doc: dict[str, Any] = {
        "run_id": "run",
        "checkpoint": name,
        "name": name,
        "save": save,
        "node_rank": rank,
        "nodes": 2,
        "step": 10,
        "layout": "dcp",
        "writer": "cluster-2",
        "host": f"node-{rank}",
        "peer": f"peer-{rank}",
        "address": "127.0.0.1:1",
        "created_at": "2026-12-06T12:00:00Z",
        "total_bytes": 0,
        "files": [],
        **extra,
    }
    return Replica.model_validate(doc)


async def push(
    client: PeerClient,
    to: Holder | str,
    files: list[LocalFile],
    *,
    deadline_s: float = 60,
    digests: bool = False,
    rate_mbit: float = 0,
    **extra: Any,
) -> Any:
    """One push of ``files`` to a holder (or the address of a proxy in front of one)."""
    clock = SYSTEM_CLOCK
    return await client.push(
        to if isinstance(to, str) else to.address,
        header(**extra),
        files,
        pace=Pace.of_mbit(rate_mbit, clock.monotonic),
        deadline=clock.monotonic() + deadline_s,
        digests=digests,
    )
