"""This node's own parts, served read-only to a restore on another node.

A replacement node needs every node's part of the checkpoint; a surviving node holds its
own in its watch dir (and a replica of the dead node's). The replicator registers each
part it pushed (its files' paths, sizes, CRC-32C and digests, and each file's identity
when it was read: size, mtime, ctime, inode), and ``open_file`` serves a file only while
it is still that file: a checkpoint rewritten or deleted since is never served (and is
dropped from the list). The files are opened relative to the watch dir's descriptor,
without following a link at any level, read-only: serving never writes a byte there.

The restore holds every byte to the store's manifest anyway; this only keeps a changed
file from being offered at all.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.manifest import check_path_component
from ckptd.peers.model import Holding, Replica, replica_id
from ckptd.peers.replicas import CorruptError, UnknownTransferError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Own parts kept listed per run (the newest; older ones are superseded for a restore).
KEEP_PER_RUN = 4

Identity = tuple[int, int, int, int]
"""A file as it was read: ``(size, mtime_ns, ctime_ns, inode)``."""


def identity_of(st: os.stat_result) -> Identity:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@dataclass
class _Own:
    holding: Holding
    watch_dir: Path
    identities: list[Identity]
    registered_at: float


@dataclass
class OwnParts:
    """The parts this node can serve from its watch dirs (module doc). Thread-safe."""

    _parts: dict[str, _Own] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(
        self, replica: Replica, watch_dir: Path, identities: list[Identity], now: float
    ) -> str:
        """List ``replica``'s files, read from ``watch_dir/<name>/`` with these identities."""
        hid = "own-" + replica_id(replica)
        holding = Holding(
            id=hid,
            kind="own",
            run_id=replica.run_id,
            checkpoint=replica.checkpoint,
            name=replica.name,
            save=replica.save,
            node_rank=replica.node_rank,
            files=list(replica.files),
        )
        with self._lock:
            self._parts[hid] = _Own(holding, watch_dir, list(identities), now)
            same_run = sorted(
                (p for p in self._parts.values() if p.holding.run_id == replica.run_id),
                key=lambda p: p.registered_at,
            )
            for old in same_run[:-KEEP_PER_RUN]:
                self._parts.pop(old.holding.id, None)
        return hid

    def holdings(self, run: str | None = None) -> list[Holding]:
        with self._lock:
            return [
                p.holding for p in self._parts.values() if run is None or p.holding.run_id == run
            ]

    def open_file(self, hid: str, index: int) -> tuple[int, int]:
        """``(fd, size)`` of one of the part's files, if it is still the file that was
        read; else CorruptError, and the part is no longer listed."""
        with self._lock:
            own = self._parts.get(hid)
        if own is None or not 0 <= index < len(own.holding.files):
            raise UnknownTransferError(f"no file {index} of {hid}")
        entry = own.holding.files[index]
        name = check_path_component(own.holding.name)
        single = len(own.holding.files) == 1 and entry.path == name  # one-file checkpoint
        parts = [name] if single else [name, *entry.path.split("/")]
        fd = os.open(own.watch_dir, _DIR_FLAGS)
        try:
            for name in parts[:-1]:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            self._drop(hid)
            raise CorruptError(f"{own.holding.name}/{entry.path} is gone here: {exc}") from exc
        finally:
            os.close(fd)
        st = os.fstat(file_fd)
        if identity_of(st) != own.identities[index]:
            os.close(file_fd)
            self._drop(hid)
            raise CorruptError(f"{own.holding.name}/{entry.path} changed since it was read")
        return file_fd, st.st_size

    def _drop(self, hid: str) -> None:
        with self._lock:
            self._parts.pop(hid, None)


__all__ = ["KEEP_PER_RUN", "Identity", "OwnParts", "identity_of"]
