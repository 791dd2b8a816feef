"""Receiving a part: an offer reserves room, chunks arrive checked, a seal makes it held.

    begin        the offer's bytes reserved in the quota (``ReplicaStore.reserve``: the
                 oldest replicas evicted first), its files made empty under
                 ``incoming/<transfer>/data/`` (fd-relative, ``O_EXCL | O_NOFOLLOW``)
    write_chunk  one chunk written at its offset only if its CRC-32C is the one its
                 request names; its CRC (and 1 MiB block digests) kept in memory
    seal         every chunk of every file there; each file's CRC-32C folded from its
                 chunks' (and its digest from their blocks') is the replica's; every file
                 fsynced, ``replica.json`` written, then the one rename into ``held/``
                 (``ReplicaStore.adopt``): only then is the part acknowledged

What arrived lives only in this process: a holder that restarts discards ``incoming/``
(``ReplicaStore.open``), so a transfer its restart cut is never sealed or served; the
sender finds the transfer unknown and begins again. A transfer idle for
``TRANSFER_IDLE_SECONDS`` is given up and its reservation freed. Blocking, thread-safe.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptd.core import checksum, digest
from ckptd.peers.model import CHUNK_BYTES, Offer, Replica, chunk_spans, matches_offer, replica_id
from ckptd.peers.replicas import (
    DATA,
    INCOMING,
    REPLICA_NAME,
    STATE_NAME,
    CorruptError,
    QuotaFullError,
    ReplicaError,
    ReplicaStore,
    UnknownTransferError,
    write_file,
)
from ckptd.runtime import writeback

#: Bytes per ``pwrite``: one 8 MiB write into the page cache costs 2-8x the CPU of eight
#: 1 MiB ones here (measured 2026-12-07: 0.5-1.95 against 0.21-0.24 CPU-s per GiB).
WRITE_PIECE = 1024 * 1024
#: A chunk a stream received whole into its page-aligned buffer, a multiple of this long,
#: is written with ``O_DIRECT``: no copy into the page cache, which was most of the
#: holder's CPU (measured 2026-12-07: 1 GiB in 8 MiB writes 0.04 CPU-s against 0.22-0.26
#: through the page cache, the same time with the fsync). Its last, shorter chunk and
#: HTTP's pieces go through the page cache.
DIRECT_ALIGN = 4096
#: A transfer with no chunk for this long is given up and its reservation freed.
TRANSFER_IDLE_SECONDS = 600.0


@dataclass
class _Transfer:
    id: str
    offer: Offer
    # Per file: chunk offset -> (crc32c, length, block digests when the offer has digests).
    chunks: list[dict[int, tuple[int, int, list[bytes]]]]
    last_active: float
    writing: int = 0
    sealing: bool = False  # no chunk is written once the seal has begun checking


@dataclass
class Receiver:
    """The transfers in progress into one ``ReplicaStore`` (module doc)."""

    store: ReplicaStore
    _transfers: dict[str, _Transfer] = field(default_factory=dict)
    # Whether page-aligned chunks are written with O_DIRECT (until the filesystem refuses).
    _direct: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, offer: Offer, now: float) -> str:
        """Reserve the offer's bytes and make its files, empty; the transfer's id.
        QuotaFullError when the quota or the filesystem cannot take it."""
        tid = secrets.token_hex(16)
        self.store.reserve(tid, offer)
        tree = self.store.tree()
        try:
            if not self.store.room_on_disk(offer.total_bytes):
                raise QuotaFullError("the filesystem holding peers.dir has no room for the part")
            tree.dir((INCOMING, tid, DATA), create=True)
            for f in offer.files:
                os.close(tree.create((INCOMING, tid, DATA, *f.path.split("/"))))
        except BaseException:
            tree.close()
            self.abort(tid)
            raise
        tree.close()
        with self._lock:
            self._transfers[tid] = _Transfer(tid, offer, [{} for _ in offer.files], now)
        return tid

    def _transfer(self, tid: str) -> _Transfer:
        found = self._transfers.get(tid)
        if found is None:
            raise UnknownTransferError(f"no transfer {tid}")
        return found

    def write_chunk(
        self,
        tid: str,
        index: int,
        offset: int,
        data: bytes | memoryview | list[bytes] | list[memoryview],
        crc_hex: str,
        now: float,
        *,
        aligned: bool = False,
    ) -> None:
        """Write one chunk (``data``: its bytes, or the pieces they arrived in), if its
        bytes are the ones ``crc_hex`` names (CorruptError). ``aligned``: ``data`` starts
        on a page (a stream's buffer), so it may be written past the page cache."""
        pieces: Sequence[bytes | memoryview] = data if isinstance(data, list) else [data]
        length = sum(len(p) for p in pieces)
        with self._lock:
            transfer = self._transfer(tid)
            if transfer.sealing:
                raise ReplicaError(f"transfer {tid} is being sealed")
            if not 0 <= index < len(transfer.offer.files):
                raise ReplicaError(f"transfer {tid} has no file {index}")
            entry = transfer.offer.files[index]
            if dict(chunk_spans(entry.size)).get(offset) != length:
                raise ReplicaError(
                    f"{entry.path}: a chunk at {offset} of {length} bytes is not one of "
                    f"its {CHUNK_BYTES}-byte chunks"
                )
            transfer.writing += 1
            transfer.last_active = now
        try:
            crc, pos = 0, 0
            sums = digest.RangeDigest() if transfer.offer.digest else None
            for piece in pieces:
                crc = checksum.crc32c(piece, crc)
                if sums is not None:
                    sums.update(pos, piece)
                pos += len(piece)
            if checksum.to_hex(crc) != crc_hex:
                raise CorruptError(
                    f"{entry.path}: chunk at {offset} has crc32c {checksum.to_hex(crc)}, "
                    f"its request says {crc_hex}"
                )
            direct = aligned and len(pieces) == 1 and length % DIRECT_ALIGN == 0 and length > 0
            self._write(tid, entry.path, offset, pieces, direct=direct and self._direct)
            with self._lock:
                if tid in self._transfers:
                    transfer.chunks[index][offset] = (
                        crc,
                        length,
                        sums.finish() if sums is not None else [],
                    )
        finally:
            with self._lock:
                transfer.writing -= 1

    def _write(
        self,
        tid: str,
        path: str,
        offset: int,
        pieces: Sequence[bytes | memoryview],
        *,
        direct: bool = False,
    ) -> None:
        """``pieces`` from ``offset`` of the transfer's file, opened without following a
        link; ``direct``: one page-aligned piece, written with ``O_DIRECT`` where the
        filesystem takes it (else, from then on, through the page cache)."""
        parts = (INCOMING, tid, DATA, *path.split("/"))
        tree = self.store.tree()
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(
                parts[-1],
                flags | (os.O_DIRECT if direct else 0),
                dir_fd=tree.dir(parts[:-1], create=False),
            )
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise UnknownTransferError(
                    f"transfer {tid}'s {path} cannot be opened: {exc}"
                ) from exc
            fd = -1  # no O_DIRECT here (tmpfs and the like)
        finally:
            tree.close()
        if fd < 0:
            self._direct = False
            return self._write(tid, path, offset, pieces)
        if direct:
            try:
                view, done = memoryview(pieces[0]), 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False  # written again below, through the page cache
            finally:
                os.close(fd)
            return self._write(tid, path, offset, pieces)
        try:
            pos = offset
            for piece in pieces:
                view, done = memoryview(piece), 0
                while done < len(view):
                    done += os.pwrite(fd, view[done : done + WRITE_PIECE], pos + done)
                pos += len(view)
            writeback.start(fd, offset, pos - offset)
        finally:
            os.close(fd)

    def received(self, tid: str) -> dict[int, list[int]]:
        """Per file index, the offsets of the chunks received (a sender resuming)."""
        with self._lock:
            transfer = self._transfer(tid)
            return {i: sorted(c) for i, c in enumerate(transfer.chunks) if c}

    def seal(self, tid: str, replica: Replica, now: float) -> str:
        """Check every file against ``replica``, fsync, and move the part into ``held/``;
        the replica's id. CorruptError naming the first file that does not match."""
        with self._lock:
            transfer = self._transfer(tid)
            if transfer.writing or transfer.sealing:
                raise ReplicaError(f"transfer {tid} still has chunks being written")
            transfer.sealing = True
        try:
            self._check(transfer, replica)
            rid = replica_id(replica)
            self._fsync_and_describe(tid, replica, now)
            self.store.adopt(tid, rid, replica, now)
        finally:
            transfer.sealing = False
        with self._lock:
            self._transfers.pop(tid, None)
        return rid

    @staticmethod
    def _check(transfer: _Transfer, replica: Replica) -> None:
        why = matches_offer(replica, transfer.offer)
        if why is not None:
            raise ReplicaError(why)
        for entry, chunks in zip(replica.files, transfer.chunks, strict=True):
            spans = chunk_spans(entry.size)
            missing = [o for o, _ in spans if o not in chunks]
            if missing:
                raise ReplicaError(f"{entry.path}: {len(missing)} chunk(s) not received")
            crc = checksum.to_hex(checksum.combine_parts((chunks[o][0], n) for o, n in spans))
            if crc != entry.crc32c:
                raise CorruptError(f"{entry.path}: crc32c {crc}, the replica says {entry.crc32c}")
            if replica.digest is not None:
                found = digest.file_digest(entry.size, (b for o, _ in spans for b in chunks[o][2]))
                if found != entry.digest:
                    raise CorruptError(f"{entry.path}: its digest is not the replica's")

    def _fsync_and_describe(self, tid: str, replica: Replica, now: float) -> None:
        """Every file fsynced (and of its size), then ``replica.json`` and ``state.json``."""
        tree = self.store.tree()
        try:
            for entry in replica.files:
                parts = (INCOMING, tid, DATA, *entry.path.split("/"))
                fd = os.open(
                    parts[-1],
                    os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=tree.dir(parts[:-1], create=False),
                )
                try:
                    if os.fstat(fd).st_size != entry.size:
                        raise CorruptError(f"{entry.path}: not {entry.size} bytes on disk")
                    os.fsync(fd)
                finally:
                    os.close(fd)
            write_file(tree, (INCOMING, tid, REPLICA_NAME), replica.to_bytes())
            write_file(tree, (INCOMING, tid, STATE_NAME), f'{{"sealed_at": {now}}}'.encode())
            tree.fsync_dirs()
        finally:
            tree.close()

    def abort(self, tid: str) -> None:
        """Drop a transfer and its files; its reservation is freed."""
        with self._lock:
            self._transfers.pop(tid, None)
        self.store.release(tid)
        self.store.remove((INCOMING, tid))

    def expire(self, now: float) -> list[str]:
        """Abort every transfer idle for ``TRANSFER_IDLE_SECONDS``; their ids."""
        with self._lock:
            idle = [
                t.id
                for t in self._transfers.values()
                if not t.writing and now - t.last_active > TRANSFER_IDLE_SECONDS
            ]
        for tid in idle:
            self.abort(tid)
        return idle


__all__ = ["TRANSFER_IDLE_SECONDS", "Receiver"]
