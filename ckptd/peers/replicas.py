"""The replica directory: other nodes' parts, held on this node's disk within a quota.

    <peers.dir>/incoming/<transfer>/data/<path>   a part being received, chunk by chunk
    <peers.dir>/held/<replica id>/data/<path>     a sealed replica's files
    <peers.dir>/held/<replica id>/replica.json    its replica document (``ckptd.peers.model``),
                                                  written after every file verified and
                                                  was fsynced; the rename into held/ last
    <peers.dir>/held/<replica id>/state.json      when it was sealed; delivered (its origin's
                                                  part is in the store) or handed off

What this module keeps, whatever a peer sends:

- **Nothing is written outside ``peers.dir``.** Every entry is made relative to a
  directory descriptor opened with ``O_NOFOLLOW`` at every level (the restore's
  ``StagingTree``), files with ``O_EXCL | O_NOFOLLOW``; paths were checked by the model
  (relative, no ``..``, no empty part) before anything is made. A symlink planted in the
  tree redirects nothing.
- **Only verified bytes are held.** A chunk is written only if its CRC-32C is the one its
  request names; a replica is sealed (moved into ``held/``, listed, served) only once
  every chunk of every file arrived and each file's CRC-32C, folded from its chunks (and
  its BLAKE3 digest, authenticated), is the replica document's, and every file is
  fsynced. ``incoming/`` is discarded at start: a transfer a restart cut is never served.
- **The quota bounds it.** Held and reserved bytes stay within ``quota_bytes``: an offer
  reserves its bytes before its first chunk; room is made by evicting the replica sealed
  longest ago first, never one pinned (being read, or handed off); an offer that still does
  not fit is refused (``QuotaFullError``), and so is one the filesystem has no room for.
- **The node's own checkpoints are never touched**: ``peers.dir`` may neither be nor hold
  a watch dir (``ckptd.config``).

Blocking, thread-safe (one lock for the bookkeeping; file I/O outside it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core.errors import CkptdError
from ckptd.core.manifest import ManifestError
from ckptd.peers.model import (
    Holding,
    Offer,
    Replica,
    parse_replica,
    replica_id,
)
from ckptd.store.restore.staging import StagingTree

INCOMING = "incoming"
HELD = "held"
DATA = "data"
REPLICA_NAME = "replica.json"
STATE_NAME = "state.json"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ReplicaError(CkptdError):
    """A request the replica directory refuses; ``reason`` is the metric's label."""

    reason = "bad_request"


class QuotaFullError(ReplicaError):
    reason = "quota"


class CorruptError(ReplicaError):
    """Bytes that do not match what they claim (a chunk, a file at seal, a file at rest)."""

    reason = "corrupt"


class UnknownTransferError(ReplicaError):
    """No such transfer: never begun, expired, or begun before this process started."""

    reason = "unknown"


@dataclass
class HeldReplica:
    """A sealed replica and what became of it."""

    id: str
    replica: Replica
    sealed_at: float
    delivered: bool = False  # its origin's part is in the store
    handed_off: bool = False  # this node put it there in the origin's name
    pins: int = 0  # reads and hand-offs in progress: never evicted meanwhile

    def holding(self) -> Holding:
        r = self.replica
        return Holding(
            id=self.id,
            kind="replica",
            run_id=r.run_id,
            checkpoint=r.checkpoint,
            name=r.name,
            save=r.save,
            node_rank=r.node_rank,
            files=list(r.files),
        )


@dataclass
class ReplicaStore:
    """The replica directory under ``root`` (module doc). ``open`` before use."""

    root: Path
    quota_bytes: int
    log: Any
    _fd: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reserved: dict[str, int] = field(default_factory=dict)
    _held: dict[str, HeldReplica] = field(default_factory=dict)
    evicted: int = 0

    # -- start -------------------------------------------------------------------------

    def open(self) -> None:
        """Make the directory (mode 0700), drop what an earlier process left incoming,
        and list what it sealed (a replica whose files are not all there, of their size,
        is removed: it was damaged at rest)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fd = os.open(self.root, _DIR_FLAGS)
        for sub in (INCOMING, HELD):
            st = self._lstat((sub,))
            if st is not None and not stat.S_ISDIR(st.st_mode):
                os.unlink(sub, dir_fd=self._fd)  # a file or symlink where ours goes
                st = None
            if sub == INCOMING and st is not None:
                shutil.rmtree(sub, dir_fd=self._fd)
                st = None
            if st is None:
                os.mkdir(sub, 0o700, dir_fd=self._fd)
        held_fd = os.open(HELD, _DIR_FLAGS, dir_fd=self._fd)
        try:
            names = os.listdir(held_fd)
        finally:
            os.close(held_fd)
        for name in names:
            found = self._load(name)
            if found is None:
                self.log.warning("peer_replica_discarded", replica=name, why="damaged at rest")
                self.remove((HELD, name))
            else:
                self._held[name] = found
        self.log.info("peer_replicas_loaded", replicas=len(self._held), bytes=self.used_bytes())

    @property
    def is_open(self) -> bool:
        return self._fd >= 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _lstat(self, parts: tuple[str, ...]) -> os.stat_result | None:
        tree = self.tree()
        try:
            return tree.lstat(parts)
        finally:
            tree.close()

    def tree(self) -> StagingTree:
        """A tree over ``root`` of its own (one per operation: ``StagingTree`` is used from
        one thread), on a duplicate of the root's descriptor."""
        return StagingTree(os.dup(self._fd))

    def _load(self, name: str) -> HeldReplica | None:
        tree = self.tree()
        try:
            body = _read(tree, (HELD, name, REPLICA_NAME))
            if body is None:
                return None
            try:
                replica = parse_replica(body)
            except ManifestError:
                return None
            if replica_id(replica) != name:
                return None
            for f in replica.files:
                st = tree.lstat((HELD, name, DATA, *f.path.split("/")))
                if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                    return None
            state = _read(tree, (HELD, name, STATE_NAME))
            doc = _json_or_empty(state)
            sealed_at = doc.get("sealed_at")
            if not isinstance(sealed_at, int | float):
                own = tree.lstat((HELD, name, REPLICA_NAME))
                sealed_at = own.st_mtime if own is not None else 0.0
            return HeldReplica(
                name,
                replica,
                float(sealed_at),
                delivered=bool(doc.get("delivered")),
                handed_off=bool(doc.get("handed_off")),
            )
        finally:
            tree.close()

    # -- the quota -----------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes held in sealed replicas."""
        return sum(h.replica.total_bytes for h in self._held.values())

    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    def free_bytes(self) -> int:
        """What an offer could take without evicting anything."""
        with self._lock:
            return max(0, self.quota_bytes - self.used_bytes() - self.reserved_bytes())

    def _make_room(self, need: int) -> list[HeldReplica]:
        """Evict (under the lock) the replicas sealed longest ago, unpinned, until ``need``
        more bytes fit; QuotaFullError when they cannot."""
        if need > self.quota_bytes:
            raise QuotaFullError(
                f"the part needs {need} bytes and the whole quota is {self.quota_bytes}"
            )
        gone: list[HeldReplica] = []
        order = sorted(self._held.values(), key=lambda h: (h.sealed_at, h.id))
        while self.used_bytes() + self.reserved_bytes() + need > self.quota_bytes:
            victim = next((h for h in order if h.pins == 0 and h not in gone), None)
            if victim is None:
                raise QuotaFullError(
                    f"the part needs {need} bytes; {self.quota_bytes - self.used_bytes()} "
                    "of the quota are free and nothing more can be evicted"
                )
            gone.append(victim)
            del self._held[victim.id]
        return gone

    # -- reservations (``ckptd.peers.receiving``) -------------------------------------

    def reserve(self, key: str, offer: Offer) -> None:
        """Reserve ``offer``'s bytes under ``key``, evicting the replicas sealed longest ago
        (never a pinned one) to make room; QuotaFullError when they cannot."""
        with self._lock:
            gone = self._make_room(offer.total_bytes)
            self._reserved[key] = offer.total_bytes
        for victim in gone:
            self.evicted += 1
            self.log.info(
                "peer_replica_evicted",
                replica=victim.id,
                run=victim.replica.run_id,
                checkpoint=victim.replica.checkpoint,
                node=victim.replica.node_rank,
                bytes=victim.replica.total_bytes,
            )
            self.remove((HELD, victim.id))

    def release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)

    def adopt(self, tid: str, rid: str, replica: Replica, now: float) -> None:
        """Move ``incoming/<tid>`` (verified, fsynced, described) to ``held/<rid>``, and
        free its reservation: the part is held from here on. The same content held
        already keeps the one there."""
        tree = self.tree()
        try:
            root = tree.dir((), create=False)
            with self._lock:
                self._reserved.pop(tid, None)
                exists = rid in self._held
                if not exists:
                    os.rename(
                        f"{INCOMING}/{tid}", f"{HELD}/{rid}", src_dir_fd=root, dst_dir_fd=root
                    )
                    self._held[rid] = HeldReplica(rid, replica, now)
            if exists:
                shutil.rmtree(f"{INCOMING}/{tid}", dir_fd=root)
            os.fsync(tree.dir((HELD,), create=False))
        finally:
            tree.close()

    def room_on_disk(self, need: int) -> bool:
        fs = os.statvfs(self._fd)
        return fs.f_bavail * fs.f_frsize >= need

    # -- what is held ----------------------------------------------------------------------

    def held(self) -> list[HeldReplica]:
        with self._lock:
            return sorted(self._held.values(), key=lambda h: (h.sealed_at, h.id))

    def get(self, rid: str) -> HeldReplica | None:
        with self._lock:
            return self._held.get(rid)

    def holdings(self, run: str | None = None) -> list[Holding]:
        return [h.holding() for h in self.held() if run is None or h.replica.run_id == run]

    @contextlib.contextmanager
    def pinned(self, rid: str) -> Iterator[HeldReplica]:
        """The replica, never evicted while in this block (a read, a hand-off)."""
        with self._lock:
            held = self._held.get(rid)
            if held is None:
                raise UnknownTransferError(f"no replica {rid}")
            held.pins += 1
        try:
            yield held
        finally:
            with self._lock:
                held.pins -= 1

    def open_file(self, rid: str, index: int) -> tuple[int, int]:
        """``(fd, size)`` of one file of a held replica, opened without following a link;
        CorruptError when its size on disk is not the replica's (damaged at rest)."""
        held = self.get(rid)
        if held is None or not 0 <= index < len(held.replica.files):
            raise UnknownTransferError(f"no file {index} of replica {rid}")
        entry = held.replica.files[index]
        parts = (HELD, rid, DATA, *entry.path.split("/"))
        tree = self.tree()
        try:
            fd = os.open(
                parts[-1],
                os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                dir_fd=tree.dir(parts[:-1], create=False),
            )
        except OSError as exc:
            raise CorruptError(f"{entry.path} of replica {rid} is gone: {exc}") from exc
        finally:
            tree.close()
        size = os.fstat(fd).st_size
        if size != entry.size:
            os.close(fd)
            raise CorruptError(f"{entry.path} of replica {rid} is {size} bytes, not {entry.size}")
        return fd, size

    def mark(
        self, rid: str, *, delivered: bool | None = None, handed_off: bool | None = None
    ) -> None:
        """Record what became of a replica (its ``state.json``, rewritten)."""
        with self._lock:
            held = self._held.get(rid)
            if held is None:
                return
            if delivered is not None:
                held.delivered = delivered
            if handed_off is not None:
                held.handed_off = handed_off
            doc = {
                "sealed_at": held.sealed_at,
                "delivered": held.delivered,
                "handed_off": held.handed_off,
            }
        tree = self.tree()
        try:
            write_file(tree, (HELD, rid, STATE_NAME), json.dumps(doc).encode(), replace=True)
        except OSError as exc:
            self.log.warning("peer_replica_state_not_written", replica=rid, error=str(exc))
        finally:
            tree.close()

    def remove(self, parts: tuple[str, ...]) -> None:
        tree = self.tree()
        try:
            parent = tree.dir(parts[:-1], create=False)
            st = tree.lstat(parts)
            if st is None:
                return
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(parts[-1], dir_fd=parent)
            else:
                os.unlink(parts[-1], dir_fd=parent)
        except OSError as exc:
            self.log.warning("peer_replica_not_removed", path="/".join(parts), error=str(exc))
        finally:
            tree.close()


def _read(tree: StagingTree, parts: tuple[str, ...]) -> bytes | None:
    try:
        fd = os.open(
            parts[-1],
            os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
            dir_fd=tree.dir(parts[:-1], create=False),
        )
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        return fh.read(16 * 1024 * 1024)


def _json_or_empty(body: bytes | None) -> dict[str, Any]:
    if body is None:
        return {}
    try:
        doc = json.loads(body)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def write_file(
    tree: StagingTree, parts: tuple[str, ...], body: bytes, *, replace: bool = False
) -> None:
    """Write ``body`` as ``parts`` (a temporary name, fsynced, renamed over: a reader never
    sees half of it)."""
    parent = tree.dir(parts[:-1], create=False)
    tmp = f".{parts[-1]}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=parent)
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=parent,
    )
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
    if replace:
        os.fsync(parent)


__all__ = [
    "CorruptError",
    "HeldReplica",
    "QuotaFullError",
    "ReplicaError",
    "ReplicaStore",
    "UnknownTransferError",
    "write_file",
]
