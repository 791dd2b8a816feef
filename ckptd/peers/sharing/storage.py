"""The store as a shared restore reads it: each range from the node the board names.

``SharedStorage`` wraps the storage a restore would read (the store, or the ``peers``
tier's, which reads replicas on peers first) and answers each ranged read of one of the
manifest's objects from where ``ShareSession.source`` says: a participant that verified
the file, or the store (this node's claim), after waiting while another node fetches
it. Everything else goes to the wrapped storage. The restore verifies every file it
keeps exactly as from the store; this module also folds the CRC-32C of what each
participant served, so that one whose bytes do not match the manifest is never asked
again (the restore's next attempt reads that file from the store or another node).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptd.core import checksum
from ckptd.core.manifest import ManifestFile
from ckptd.peers.source import PeerReader, PeerReadError
from ckptd.storage.base import RangeSink, Storage
from ckptd.storage.wrapper import StorageWrapper

if TYPE_CHECKING:
    from ckptd.peers.sharing.session import ShareSession


class SharedStorage(StorageWrapper):
    """The wrapped storage, but a manifest object's ranges come from the board's pick."""

    def __init__(
        self,
        inner: Storage,
        session: ShareSession,
        reader: PeerReader,
        numbers: Mapping[str, int],  # object key -> file number
        files: list[ManifestFile],
        log: Any,
    ) -> None:
        super().__init__(inner)
        self.url = f"shared+{inner.url}"
        self.session = session
        self.reader = reader
        self.numbers = numbers
        self.files = files
        self.log = log
        self.from_peers = 0
        self.from_store = 0
        self._served: dict[int, dict[int, tuple[int, int, str]]] = {}  # n -> start -> ...
        self._lock = threading.Lock()

    def stream_range(self, key: str, start: int, length: int, sink: RangeSink) -> None:
        number = self.numbers.get(key)
        if number is None or length == 0:
            self.inner.stream_range(key, start, length, sink)
            return
        while True:
            where, address = self.session.source(number)
            if where == "peer":
                try:
                    crc = self._read_from(address, number, start, length, sink)
                except PeerReadError as exc:
                    self.session.read_failed(address, str(exc))
                    continue
                with self._lock:
                    self.from_peers += length
                self._check(number, start, length, crc, address)
                return
            self._fetch(number, key, start, length, sink)
            return

    def _fetch(self, number: int, key: str, start: int, length: int, sink: RangeSink) -> None:
        def counted(pos: int, piece: bytes) -> None:
            sink(pos, piece)
            self.session.fetched(number, len(piece))

        try:
            self.inner.stream_range(key, start, length, counted)
        except BaseException:
            self.session.release(number)
            raise
        with self._lock:
            self.from_store += length

    def _read_from(
        self, address: str, number: int, start: int, length: int, sink: RangeSink
    ) -> int:
        """Read the range from ``address`` into ``sink``; returns its CRC-32C."""
        crc = 0

        def folded(pos: int, piece: bytes) -> None:
            nonlocal crc
            sink(pos, piece)
            crc = checksum.crc32c(piece, crc)

        target = f"/v1/share/{self.session.name}/files/{number}"
        self.reader.get_range(address, target, start, length, folded)
        return crc

    def _check(self, number: int, start: int, length: int, crc: int, address: str) -> None:
        """Fold what participants served of file ``number``; once they served all of it,
        a whole that is not the manifest's marks each of them bad (module doc)."""
        entry = self.files[number]
        with self._lock:
            served = self._served.setdefault(number, {})
            served[start] = (length, crc, address)
            if sum(n for n, _, _ in served.values()) != entry.size:
                return
            parts = sorted(served.items())
            self._served.pop(number)
        if any(s != sum(n for _, (n, _, _) in parts[:i]) for i, (s, _) in enumerate(parts)):
            return  # not one tiling of the file (a range served twice): no verdict here
        whole = checksum.combine_parts((c, n) for _, (n, c, _) in parts)
        if checksum.to_hex(whole) != entry.crc32c:
            for _, (_, _, who) in parts:
                self.session.served_badly(who, entry.path)


__all__ = ["SharedStorage"]
