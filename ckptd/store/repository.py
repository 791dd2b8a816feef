"""The store as ckptd lays it out: every key, and every read of it, in one place.

    <run>/<checkpoint>/<path>                   a checkpoint's objects
    <run>/<checkpoint>/ckptd.manifest.json      written last: present = committed
    <run>/LATEST                                the newest committed step's pointer
    <run>/.ckptd-restoring/<checkpoint>-<uuid>  a restore's lease (retention keeps off)
    <run>/NOTICE                                a preemption notice seen by any node
                                                (many nodes only; overwritten by the next)
    <run>/<checkpoint>/ckptd.announce.json      many nodes: a save is complete on the
                                                node holding the commit record
    <run>/<checkpoint>/ckptd.part-<rank>.json   many nodes: one node's verified files
    <run>/CADENCE                               the run's save costs and interruptions
                                                (``ckptd.cadence.model``; read-modify-write)
    <run>/GOODPUT.<writer>.<first>.json         the run ledger, one chunk per ship
                                                (``ckptd.goodput.model``; written once each)

Only a manifest makes a checkpoint: announcements, parts, ``<run>/NOTICE`` and
``<run>/CADENCE`` (plain objects beside ``LATEST``, never a name listing returns) are never
taken for a checkpoint (a name is one only with a manifest) nor for one of its files
(only a manifest's entries are).

A ``Repository`` wraps a ``Storage`` and is the only code that spells a key or parses
what the store holds. Committing (``ckptd.sync.commit``), retention, restore, verify and
``ckptd list`` all go through it; none of them builds a key by hand. Its reads never
mistake garbage for a commit: a manifest that does not parse is not a committed
checkpoint when listing, and is an error when asked for by name.

Objects are checked against a manifest in two ways: ``object_problems`` (present and of
the manifest's size, from one listing) and ``crc_of_object`` (re-read in ranges, each
range's CRC-32C folded into the whole file's with ``RangeCrc``, which restarts when a
retried GET hands a range over again).
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptd.cadence.model import History, parse_history
from ckptd.cluster.protocol import (
    ANNOUNCE_NAME,
    Announcement,
    Part,
    parse_announcement,
    parse_part,
    part_name,
    rank_of_part,
)
from ckptd.core import checksum
from ckptd.core.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    Latest,
    Manifest,
    ManifestError,
    parse_latest,
    parse_manifest,
)
from ckptd.storage.base import (
    ConditionalWrite,
    NotFoundError,
    ObjectInfo,
    Storage,
    require_capability,
)

LEASE_DIR = ".ckptd-restoring"
NOTICE_NAME = "NOTICE"
CADENCE_NAME = "CADENCE"
LEDGER_NAME = "GOODPUT"
NOTICE_FORMAT = "ckptd.notice/1"
# A NOTICE is a few hundred bytes; anything much larger is not one (never parse it).
NOTICE_MAX_BYTES = 64 * 1024
LEASE_TTL_SECONDS = 3600.0
# Ranged reads of one object: large enough that per-request cost vanishes, small
# enough that a file's ranges spread over the pool.
RANGE_BYTES = 16 * 1024 * 1024
# Manifest reads in flight while listing; within the S3 client's default connection pool.
LIST_CONCURRENCY = 8


# -- keys --------------------------------------------------------------------------------


def checkpoint_prefix(run_id: str, checkpoint: str) -> str:
    return f"{run_id}/{checkpoint}/"


def object_key(run_id: str, checkpoint: str, path: str) -> str:
    return f"{run_id}/{checkpoint}/{path}"


def manifest_key(run_id: str, checkpoint: str) -> str:
    return f"{run_id}/{checkpoint}/{MANIFEST_NAME}"


def latest_key(run_id: str) -> str:
    return f"{run_id}/{LATEST_NAME}"


def announce_key(run_id: str, checkpoint: str) -> str:
    return f"{run_id}/{checkpoint}/{ANNOUNCE_NAME}"


def part_key(run_id: str, checkpoint: str, rank: int) -> str:
    return f"{run_id}/{checkpoint}/{part_name(rank)}"


def lease_prefix(run_id: str) -> str:
    return f"{run_id}/{LEASE_DIR}/"


def notice_key(run_id: str) -> str:
    return f"{run_id}/{NOTICE_NAME}"


def cadence_key(run_id: str) -> str:
    return f"{run_id}/{CADENCE_NAME}"


def ledger_prefix(run_id: str) -> str:
    return f"{run_id}/{LEDGER_NAME}."


def ledger_chunk_key(run_id: str, writer: str, first: int) -> str:
    return f"{ledger_prefix(run_id)}{writer}.{first:08d}.json"


# -- pure helpers ------------------------------------------------------------------------


def chunk_ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each ranged GET of an object of ``size`` bytes."""
    return [(start, min(chunk, size - start)) for start in range(0, size, chunk)]


class RangeCrc:
    """The CRC-32C of one range as ``Storage.stream_range`` hands it over; a retried GET
    starts again from ``pos == 0``, and so does the value."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, pos: int, piece: bytes) -> None:
        self.value = checksum.crc32c(piece, self.value if pos else 0)


def lease_checkpoint(body: bytes, key_name: str) -> str | None:
    """The checkpoint a lease protects: from its JSON body, else from ``<NAME>-<uuid>``."""
    try:
        doc = json.loads(body)
        name = doc.get("checkpoint") if isinstance(doc, dict) else None
        if isinstance(name, str) and name:
            return name
    except ValueError:
        pass
    head, sep, token = key_name.rpartition("-")
    return head if sep and len(token) == 32 else None


def parse_notice_document(body: bytes) -> dict[str, Any] | None:
    """A NOTICE's JSON object when it is one of ours (``format`` ckptd.notice/1), else None;
    never raises: garbage in the store is no notice."""
    if len(body) > NOTICE_MAX_BYTES:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != NOTICE_FORMAT:
        return None
    return doc


def lease_is_fresh(body: bytes, now: float, ttl: float = LEASE_TTL_SECONDS) -> bool:
    """Whether a lease was taken less than ``ttl`` seconds before ``now``; a lease
    whose time cannot be read counts as fresh (when unsure, keep)."""
    try:
        doc = json.loads(body)
        taken = float(doc["taken_at"])
    except (ValueError, KeyError, TypeError):
        return True
    return now - taken < ttl


@dataclass(frozen=True)
class CommittedCheckpoint:
    run_id: str
    manifest: Manifest
    is_latest: bool


@dataclass(frozen=True)
class FileProblem:
    """A manifest file whose object (or local copy) does not match; ``problem`` says how."""

    path: str
    problem: str


@dataclass(frozen=True)
class ObjectMismatch:
    """One object that is missing (``found`` None) or of another size than the manifest's."""

    path: str
    found: int | None
    expected: int


# -- the repository ------------------------------------------------------------------------


class Repository:
    """Reads (and the few layout writes) of the store, by run and checkpoint name."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # -- manifests and LATEST --------------------------------------------------------------

    def read_manifest_bytes(self, run_id: str, checkpoint: str) -> bytes | None:
        """The manifest as stored, or None if the checkpoint is not committed."""
        try:
            return self.storage.get_bytes(manifest_key(run_id, checkpoint))
        except NotFoundError:
            return None

    def read_manifest(self, run_id: str, checkpoint: str) -> Manifest | None:
        """The committed manifest of a checkpoint, or None if it is not committed;
        ManifestError if one is there but cannot be trusted."""
        body = self.read_manifest_bytes(run_id, checkpoint)
        if body is None:
            return None
        try:
            return parse_manifest(body)
        except ManifestError as exc:
            # Name the object: "which manifest?" is the operator's first question.
            raise ManifestError(f"{exc} (in {manifest_key(run_id, checkpoint)})") from None

    def has_manifest(self, run_id: str, checkpoint: str) -> bool:
        """Whether a manifest object exists, parsable or not."""
        return self.storage.head(manifest_key(run_id, checkpoint)) is not None

    def put_manifest_if_absent(self, manifest: Manifest, body: bytes, crc32c: int) -> None:
        """The commit write: PreconditionFailedError if a manifest is there already."""
        # Without a conditional write two commits could both 'win': no commit at all, then.
        conditional = require_capability(self.storage, ConditionalWrite, "commit a checkpoint")
        conditional.put_if_absent(
            manifest_key(manifest.run_id, manifest.checkpoint), body, crc32c=crc32c
        )

    def read_latest(self, run_id: str) -> Latest | None:
        """The run's LATEST pointer, or None if absent or unreadable."""
        try:
            return parse_latest(self.storage.get_bytes(latest_key(run_id)))
        except (NotFoundError, ManifestError):
            return None

    def write_latest(self, run_id: str, pointer: Latest) -> None:
        data = pointer.to_bytes()
        self.storage.put_bytes(latest_key(run_id), data, crc32c=checksum.crc32c(data))

    # -- listing and resolving -------------------------------------------------------------

    def list_runs(self) -> list[str]:
        return self.storage.list_children("")

    def list_names(self, run_id: str) -> list[str]:
        """Every name directly under the run (checkpoints, orphans, dot-dirs)."""
        return self.storage.list_children(f"{run_id}/")

    def list_committed(
        self, run_id: str, *, concurrency: int = LIST_CONCURRENCY
    ) -> list[CommittedCheckpoint]:
        """Committed checkpoints of a run, oldest first (by step, then commit time).

        One manifest GET per checkpoint, ``concurrency`` at a time: each is a small
        request whose time is the round trip, so a run with a thousand checkpoints lists
        in a fraction of the time one by one would take."""
        latest = self.read_latest(run_id)

        def read(name: str) -> Manifest | None:
            try:
                return self.read_manifest(run_id, name)
            except ManifestError:
                return None  # a manifest that does not parse is not a committed checkpoint

        names = self.list_names(run_id)
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            manifests = list(pool.map(read, names))
        found = [
            CommittedCheckpoint(run_id, m, latest is not None and latest.checkpoint == name)
            for name, m in zip(names, manifests, strict=True)
            if m is not None
        ]
        found.sort(
            key=lambda c: (
                c.manifest.step if c.manifest.step is not None else -1,
                c.manifest.committed_at,
            )
        )
        return found

    def resolve(self, run_id: str, checkpoint: str | None) -> Manifest:
        """The manifest of ``checkpoint``, or with None the newest committed one: LATEST's,
        falling back to the newest manifest when LATEST is missing or names nothing
        committed. NotFoundError when there is none."""
        if checkpoint is not None:
            manifest = self.read_manifest(run_id, checkpoint)
            if manifest is None:
                raise NotFoundError(
                    f"{run_id}/{checkpoint} is not committed "
                    f"(no {manifest_key(run_id, checkpoint)})"
                )
            return manifest
        latest = self.read_latest(run_id)
        if latest is not None:
            try:
                named = self.read_manifest(run_id, latest.checkpoint)
            except ManifestError:
                named = None
            if named is not None:
                return named
        committed = self.list_committed(run_id)
        if not committed:
            raise NotFoundError(f"run {run_id!r} has no committed checkpoint")
        return committed[-1].manifest

    # -- objects -----------------------------------------------------------------------

    def list_objects(self, run_id: str, checkpoint: str) -> list[ObjectInfo]:
        return list(self.storage.list_objects(checkpoint_prefix(run_id, checkpoint)))

    def delete(self, keys: list[str]) -> None:
        if keys:
            self.storage.delete(keys)

    def object_mismatches(self, manifest: Manifest) -> list[ObjectMismatch]:
        """Objects missing or of another size than the manifest says, from one listing
        (and a HEAD of each object the listing lacks: a listing may lag a write)."""
        listed = {
            info.key: info.size for info in self.list_objects(manifest.run_id, manifest.checkpoint)
        }
        found: list[ObjectMismatch] = []
        for f in manifest.files:
            key = object_key(manifest.run_id, manifest.checkpoint, f.path)
            size = listed.get(key)
            if size is None:
                info = self.storage.head(key)
                size = None if info is None else info.size
            if size != f.size:
                found.append(ObjectMismatch(f.path, size, f.size))
        return found

    def crc_of_object(
        self, key: str, size: int, pool: Executor, *, range_bytes: int = RANGE_BYTES
    ) -> int:
        """The CRC-32C of an object of ``size`` bytes, re-read in ranges on ``pool``."""

        def read(rng: tuple[int, int]) -> tuple[int, int]:
            crc = RangeCrc()
            self.storage.stream_range(key, rng[0], rng[1], crc.update)
            return crc.value, rng[1]

        return checksum.combine_parts(pool.map(read, chunk_ranges(size, range_bytes)))

    # -- the run's preemption NOTICE ------------------------------------------------------

    def read_notice(self, run_id: str) -> dict[str, Any] | None:
        """The run's NOTICE document, or None when there is none or it is not ours."""
        try:
            body = self.storage.get_bytes(notice_key(run_id))
        except NotFoundError:
            return None
        return parse_notice_document(body)

    def write_notice(self, run_id: str, document: Mapping[str, Any]) -> None:
        """Write (overwrite) the run's NOTICE; ``format`` is set here."""
        data = json.dumps({**document, "format": NOTICE_FORMAT}, sort_keys=True).encode()
        self.storage.put_bytes(notice_key(run_id), data, crc32c=checksum.crc32c(data))

    # -- the run's cadence history ---------------------------------------------------------

    def read_cadence(self, run_id: str) -> History:
        """The run's cadence history; an empty one when there is none or it is garbage."""
        try:
            return parse_history(self.storage.get_bytes(cadence_key(run_id)), run_id)
        except NotFoundError:
            return History(run_id)

    def write_cadence(self, history: History) -> None:
        """Write (overwrite) the run's cadence history."""
        self._put_json(cadence_key(history.run_id), history.to_bytes())

    # -- the run ledger (goodput) ----------------------------------------------------------

    def read_ledger_chunks(self, run_id: str) -> list[bytes]:
        """Every chunk of the run's ledger, as stored (parsing: ``ckptd.goodput.model``)."""
        return [
            self.storage.get_bytes(o.key) for o in self.storage.list_objects(ledger_prefix(run_id))
        ]

    def write_ledger_chunk(self, run_id: str, writer: str, first: int, body: bytes) -> None:
        """Write one chunk of the run's ledger (``first``: the writer's first line in it)."""
        self._put_json(ledger_chunk_key(run_id, writer, first), body)

    # -- many nodes: announcements and parts ------------------------------------------------

    def _put_json(self, key: str, body: bytes) -> None:
        self.storage.put_bytes(key, body, crc32c=checksum.crc32c(body))

    def read_announcement(self, run_id: str, checkpoint: str) -> Announcement | None:
        """The checkpoint's announcement, or None if absent or unreadable (an unreadable
        one is overwritten by the next announcer, and commits nothing meanwhile)."""
        try:
            return parse_announcement(self.storage.get_bytes(announce_key(run_id, checkpoint)))
        except (NotFoundError, ManifestError):
            return None

    def write_announcement(self, announcement: Announcement) -> None:
        key = announce_key(announcement.run_id, announcement.checkpoint)
        self._put_json(key, announcement.to_bytes())

    def write_part(self, part: Part) -> None:
        self._put_json(part_key(part.run_id, part.checkpoint, part.node_rank), part.to_bytes())

    def read_part(self, run_id: str, checkpoint: str, rank: int) -> Part | None:
        """One node's part, or None if absent or unreadable."""
        try:
            return parse_part(self.storage.get_bytes(part_key(run_id, checkpoint, rank)))
        except (NotFoundError, ManifestError):
            return None

    def read_parts(
        self, run_id: str, checkpoint: str, ranks: list[int] | None = None
    ) -> dict[int, Part]:
        """Every readable part of a checkpoint by rank (of ``ranks``, else of one listing);
        a part that does not parse, or names another rank than its key, is left out. Read
        ``LIST_CONCURRENCY`` at a time: a commit of many nodes waits on all of them."""
        todo = self.part_ranks(run_id, checkpoint) if ranks is None else list(ranks)
        with ThreadPoolExecutor(max_workers=LIST_CONCURRENCY) as pool:
            read = list(pool.map(lambda rank: self.read_part(run_id, checkpoint, rank), todo))
        return {
            rank: part
            for rank, part in zip(todo, read, strict=True)
            if part is not None and part.node_rank == rank
        }

    def part_ranks(self, run_id: str, checkpoint: str) -> list[int]:
        """Ranks with a part object under the checkpoint, from one listing."""
        ranks = []
        for info in self.list_objects(run_id, checkpoint):
            rank = rank_of_part(info.key.rsplit("/", 1)[-1])
            if rank is not None and info.key == part_key(run_id, checkpoint, rank):
                ranks.append(rank)
        return sorted(ranks)

    def cluster_keys(self, run_id: str, checkpoint: str) -> list[str]:
        """Keys of the checkpoint's announcement and parts (what the sweep removes)."""
        keys = [part_key(run_id, checkpoint, r) for r in self.part_ranks(run_id, checkpoint)]
        if self.storage.head(announce_key(run_id, checkpoint)) is not None:
            keys.append(announce_key(run_id, checkpoint))
        return keys

    # -- restore leases ------------------------------------------------------------------

    def take_lease(self, run_id: str, checkpoint: str, *, now: float) -> str:
        """Write a lease protecting ``checkpoint`` from retention; returns its key."""
        key = f"{lease_prefix(run_id)}{checkpoint}-{uuid.uuid4().hex}"
        body = json.dumps(
            {"checkpoint": checkpoint, "taken_at": now, "host": socket.gethostname()}
        ).encode()
        self.storage.put_bytes(key, body, crc32c=checksum.crc32c(body))
        return key

    def release_lease(self, key: str) -> None:
        self.storage.delete([key])

    def read_leases(
        self, run_id: str, *, now: float, ttl: float = LEASE_TTL_SECONDS
    ) -> tuple[set[str], list[str]]:
        """``(checkpoints with a fresh lease, keys of stale leases)``."""
        fresh: set[str] = set()
        stale: list[str] = []
        for info in self.storage.list_objects(lease_prefix(run_id)):
            key_name = info.key.rsplit("/", 1)[-1]
            try:
                body = self.storage.get_bytes(info.key)
            except NotFoundError:
                continue  # released while we listed
            name = lease_checkpoint(body, key_name)
            if lease_is_fresh(body, now, ttl):
                if name is not None:
                    fresh.add(name)
            else:
                stale.append(info.key)
        return fresh, stale


__all__ = [
    "CADENCE_NAME",
    "LEASE_DIR",
    "LEASE_TTL_SECONDS",
    "NOTICE_FORMAT",
    "NOTICE_NAME",
    "RANGE_BYTES",
    "CommittedCheckpoint",
    "FileProblem",
    "ObjectMismatch",
    "RangeCrc",
    "Repository",
    "announce_key",
    "cadence_key",
    "checkpoint_prefix",
    "chunk_ranges",
    "latest_key",
    "lease_checkpoint",
    "lease_is_fresh",
    "lease_prefix",
    "manifest_key",
    "notice_key",
    "object_key",
    "parse_notice_document",
    "part_key",
]
