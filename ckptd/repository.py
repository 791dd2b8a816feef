"""The store as ckptd lays it out: every key, and every read of it, in one place.

    <run>/<checkpoint>/<path>                   a checkpoint's objects
    <run>/<checkpoint>/ckptd.claim.json         written first: the one writer of them
    <run>/<checkpoint>/ckptd.manifest.json      written last: present = committed (or a
                                                redirect to the slot that is, or a
                                                withdrawal: never committed)
    <run>/LATEST                                the newest committed step's pointer
    <run>/.ckptd-restoring/<checkpoint>-<uuid>  a restore's lease (retention keeps off),
                                                or a protection with an ``until`` (a loss
                                                spike's rollback target: ``why``, ``step``)
    <run>/NOTICE                                a preemption notice seen by any node
                                                (many nodes only; overwritten by the next)
    <run>/<checkpoint>/ckptd.announce.json      many nodes: a save is complete on the
                                                node holding the commit record
    <run>/<checkpoint>/ckptd.part-<rank>.json   many nodes: one node's verified files
    <run>/CADENCE                               the run's save costs and interruptions
                                                (``ckptd.cadence.model``, read-modify-write by
                                                ``ckptd.cadence.history``)
    <run>/GOODPUT.<writer>.<first>.json         the run ledger, one chunk per ship
                                                (``ckptd.goodput.model``; written once each)
    <run>/DRILL.<started>.<writer>.json         one drill's result and stage timings
                                                (``ckptd.drill.model``; written once each)
    <run>/DRILL-PERIOD.<period>.json            a scheduled drill's claim on its period:
                                                created once, by the node that drills it
    <run>/.ckptd-peers/node-<rank>.json         a node's peer port and quota (``ckptd.peers``)
    <run>/.ckptd-sharing/<session>/<node>.json  a node restoring one checkpoint with others
                                                (``ckptd.peers.sharing``; deleted after)

``<checkpoint>`` is a *slot* (``ckptd.commit.slots``): the checkpoint's name, or
``<name>~<8 letters>`` for another content of that name; the manifest says the name.
Only a manifest makes a checkpoint: announcements, parts, ``<run>/NOTICE``,
``<run>/CADENCE``, the ledger and the drills' objects (plain objects beside ``LATEST``,
never a name listing returns) are never
taken for a checkpoint (a name is one only with a manifest) nor for one of its files
(only a manifest's entries are).

A ``Repository`` wraps a ``Storage`` and is, with ``ckptd.repository_bodies`` (the
parsers of the small objects' bodies: redirects, withdrawals, leases, NOTICE; part of
this module, and re-exported here), the only code that spells a key or parses what the
store holds. Committing (``ckptd.commit.single``), retention, restore, verify and
``ckptd list`` all go through it; none of them builds a key by hand. Its reads never
mistake garbage for a commit: a manifest that does not parse is not a committed
checkpoint when listing, and is an error when asked for by name.

Objects are checked against a manifest in two ways: ``object_problems`` (present and of
the manifest's size, from one listing) and ``crc_of_object`` (re-read in ranges, each
range's CRC-32C folded into the whole file's with ``RangeCrc``, which restarts when a
retried GET hands a range over again).
"""

from __future__ import annotations

import contextlib
import json
import socket
import uuid
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

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
from ckptd.core.names import ANNOUNCE_NAME, CLAIM_NAME, part_name, rank_of_part
from ckptd.core.ranges import RangeCrc, chunk_ranges  # re-exported: every ranged read
from ckptd.repository_bodies import (  # re-exported: the parsing half of this module
    LEASE_TTL_SECONDS,
    NOTICE_FORMAT,
    NOTICE_MAX_BYTES,
    is_withdrawal,
    lease_checkpoint,
    lease_is_fresh,
    lease_why,
    parse_notice_document,
    redirect_target,
    withdrawn_why,
)
from ckptd.storage.base import (
    ConditionalWrite,
    NotFoundError,
    ObjectInfo,
    PreconditionFailedError,
    Storage,
    require_capability,
)

LEASE_DIR = ".ckptd-restoring"
SHARING_DIR = ".ckptd-sharing"
NOTICE_NAME = "NOTICE"
CADENCE_NAME = "CADENCE"
LEDGER_NAME = "GOODPUT"
DRILL_NAME = "DRILL"
DRILL_CLAIM_NAME = "DRILL-PERIOD"
# Ranged reads of one object: large enough that per-request cost vanishes, small
# enough that a file's ranges spread over the pool.
RANGE_BYTES = 16 * 1024 * 1024
# Manifest reads in flight while listing; within the S3 client's default connection pool.
LIST_CONCURRENCY = 8


# -- keys --------------------------------------------------------------------------------


def run_prefix(run_id: str) -> str:
    return f"{run_id}/"


def checkpoint_prefix(run_id: str, checkpoint: str) -> str:
    return f"{run_id}/{checkpoint}/"


def object_key(run_id: str, checkpoint: str, path: str) -> str:
    return f"{run_id}/{checkpoint}/{path}"


def manifest_key(run_id: str, checkpoint: str) -> str:
    return f"{run_id}/{checkpoint}/{MANIFEST_NAME}"


def claim_key(run_id: str, checkpoint: str) -> str:
    return f"{run_id}/{checkpoint}/{CLAIM_NAME}"


def latest_key(run_id: str) -> str:
    return f"{run_id}/{LATEST_NAME}"


def announce_key(run_id: str, checkpoint: str) -> str:
    return f"{run_id}/{checkpoint}/{ANNOUNCE_NAME}"


def part_key(run_id: str, checkpoint: str, rank: int) -> str:
    return f"{run_id}/{checkpoint}/{part_name(rank)}"


def lease_prefix(run_id: str) -> str:
    return f"{run_id}/{LEASE_DIR}/"


def sharing_key(run_id: str, session: str, node: str | None = None) -> str:
    """A shared restore's record of ``node`` (``ckptd.peers.sharing``); without a node,
    the prefix of the session's records."""
    return f"{run_id}/{SHARING_DIR}/{session}/" + ("" if node is None else f"{node}.json")


def peer_key(run_id: str, rank: int | None = None) -> str:
    """Node ``rank``'s peer announcement (``ckptd.peers``); without a rank, their prefix."""
    return f"{run_id}/.ckptd-peers/" + ("" if rank is None else f"node-{rank}.json")


def notice_key(run_id: str) -> str:
    return f"{run_id}/{NOTICE_NAME}"


def cadence_key(run_id: str) -> str:
    return f"{run_id}/{CADENCE_NAME}"


def ledger_prefix(run_id: str) -> str:
    return f"{run_id}/{LEDGER_NAME}."


def ledger_chunk_key(run_id: str, writer: str, first: int) -> str:
    return f"{ledger_prefix(run_id)}{writer}.{first:08d}.json"


def drill_prefix(run_id: str) -> str:
    return f"{run_id}/{DRILL_NAME}."


def drill_record_key(run_id: str, drill_id: str) -> str:
    return f"{drill_prefix(run_id)}{drill_id}.json"


def drill_claim_key(run_id: str, period: str) -> str:
    return f"{run_id}/{DRILL_CLAIM_NAME}.{period}.json"


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

    def read_manifest(
        self, run_id: str, checkpoint: str, *, follow: bool = False
    ) -> Manifest | None:
        """The committed manifest of a checkpoint, or None if it is not committed;
        ManifestError if one is there but cannot be trusted. With ``follow``, a redirect
        there is followed once (to the slot holding the name's content), else it reads as
        not committed here. A withdrawal there reads as not committed, always."""
        body = self.read_manifest_bytes(run_id, checkpoint)
        if body is None or is_withdrawal(body):
            return None
        target = redirect_target(body)
        if target is not None:
            return self.read_manifest(run_id, target) if follow and target != checkpoint else None
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
        return self.storage.list_children(run_prefix(run_id))

    def list_run_objects(self, run_id: str) -> list[ObjectInfo]:
        """Every object under the run: its checkpoints' and the run's own (LATEST, ...)."""
        return list(self.storage.list_objects(run_prefix(run_id)))

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
            manifest = self.read_manifest(run_id, checkpoint, follow=True)
            if manifest is None:
                body = self.read_manifest_bytes(run_id, checkpoint)
                why = withdrawn_why(body) if body is not None else None
                raise NotFoundError(
                    f"{run_id}/{checkpoint} is not committed "
                    f"({why or f'no {manifest_key(run_id, checkpoint)}'})"
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

    def read_cadence_bytes(self, run_id: str) -> bytes | None:
        """The run's cadence history as stored (parsing: ``ckptd.cadence.model``), or None."""
        try:
            return self.storage.get_bytes(cadence_key(run_id))
        except NotFoundError:
            return None

    def write_cadence_bytes(self, run_id: str, body: bytes) -> None:
        """Write (overwrite) the run's cadence history."""
        self.put_json(cadence_key(run_id), body)

    # -- the run ledger (goodput) ----------------------------------------------------------

    def read_ledger_chunks(self, run_id: str) -> list[bytes]:
        """Every chunk of the run's ledger, as stored (parsing: ``ckptd.goodput.model``)."""
        return [
            self.storage.get_bytes(o.key) for o in self.storage.list_objects(ledger_prefix(run_id))
        ]

    def write_ledger_chunk(self, run_id: str, writer: str, first: int, body: bytes) -> None:
        """Write one chunk of the run's ledger (``first``: the writer's first line in it)."""
        self.put_json(ledger_chunk_key(run_id, writer, first), body)

    # -- the run's drills ------------------------------------------------------------------

    def read_drill_records(self, run_id: str, last: int) -> list[bytes]:
        """The ``last`` newest drill records of the run, oldest first, as stored (their
        keys sort by time; parsing: ``ckptd.drill.model``)."""
        keys = sorted(o.key for o in self.storage.list_objects(drill_prefix(run_id)))
        bodies = []
        for key in keys[-last:] if last > 0 else []:
            try:
                bodies.append(self.storage.get_bytes(key))
            except NotFoundError:
                continue  # removed while we listed
        return bodies

    def write_drill_record(self, run_id: str, drill_id: str, body: bytes) -> str:
        """Write one drill's record, once (a conditional write: one already there under
        its id is a retry of this write, and stays); returns its key."""
        key = drill_record_key(run_id, drill_id)
        conditional = require_capability(self.storage, ConditionalWrite, "record a drill")
        with contextlib.suppress(PreconditionFailedError):
            conditional.put_if_absent(key, body, crc32c=checksum.crc32c(body))
        return key

    def claim_drill_period(self, run_id: str, period: str, body: bytes) -> bool:
        """Take the run's drill of ``period`` for this node: True when this write created
        the claim, False when another node's was there first (a conditional write)."""
        conditional = require_capability(self.storage, ConditionalWrite, "schedule drills")
        try:
            conditional.put_if_absent(
                drill_claim_key(run_id, period), body, crc32c=checksum.crc32c(body)
            )
        except PreconditionFailedError:
            return False
        return True

    # -- small objects of the layout (their formats: ``ckptd.commit``, ``ckptd.cadence``) --

    def put_json(self, key: str, body: bytes) -> None:
        """Write (overwrite) a small object the layout defines; the key is one of this module's."""
        self.storage.put_bytes(key, body, crc32c=checksum.crc32c(body))

    def put_if_absent(self, key: str, body: bytes, purpose: str) -> None:
        """A create-only write of a small object the layout defines (a claim, a redirect);
        PreconditionFailedError when the key exists. ``purpose`` names what needs it."""
        conditional = require_capability(self.storage, ConditionalWrite, purpose)
        conditional.put_if_absent(key, body, crc32c=checksum.crc32c(body))

    def get_or_none(self, key: str) -> bytes | None:
        """A small object the layout defines, as stored, or None when it is absent."""
        try:
            return self.storage.get_bytes(key)
        except NotFoundError:
            return None

    # -- many nodes: which parts are there (reading them: ``ckptd.commit.objects``) --------

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

    def take_lease(
        self,
        run_id: str,
        checkpoint: str,
        *,
        now: float,
        until: float | None = None,
        why: str = "",
        detail: Mapping[str, Any] | None = None,
    ) -> str:
        """Write a lease protecting ``checkpoint`` from retention; returns its key. A
        restore's holds for the lease TTL; one with ``until`` (a protection: ``why``,
        ``detail``) until then, released early by deleting it."""
        key = f"{lease_prefix(run_id)}{checkpoint}-{uuid.uuid4().hex}"
        doc: dict[str, Any] = {"checkpoint": checkpoint, "taken_at": now}
        doc["host"] = socket.gethostname()
        if until is not None:
            doc.update({**(detail or {}), "until": until, "why": why or "protected"})
        body = json.dumps(doc).encode()
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
        for key, body in self._lease_bodies(run_id):
            name = lease_checkpoint(body, key.rsplit("/", 1)[-1])
            if lease_is_fresh(body, now, ttl):
                if name is not None:
                    fresh.add(name)
            else:
                stale.append(key)
        return fresh, stale

    def read_protections(
        self, run_id: str, *, now: float, keys: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The checkpoints a fresh protection (a lease with an ``until``) keeps, each with
        why (``loss-spike``, ``non-finite``), and into ``keys`` its lease's key; restores'
        leases are not listed."""
        found: dict[str, str] = {}
        for key, body in self._lease_bodies(run_id):
            why = lease_why(body)
            name = lease_checkpoint(body, key.rsplit("/", 1)[-1])
            if why != "restore" and name is not None and lease_is_fresh(body, now):
                found[name] = why
                (keys if keys is not None else {})[name] = key
        return found

    def _lease_bodies(self, run_id: str) -> list[tuple[str, bytes]]:
        out = []
        for info in self.storage.list_objects(lease_prefix(run_id)):
            try:
                out.append((info.key, self.storage.get_bytes(info.key)))
            except NotFoundError:
                continue  # released while we listed
        return out


__all__ = [
    "CADENCE_NAME",
    "LEASE_DIR",
    "LEASE_TTL_SECONDS",
    "NOTICE_FORMAT",
    "NOTICE_MAX_BYTES",
    "NOTICE_NAME",
    "RANGE_BYTES",
    "SHARING_DIR",
    "CommittedCheckpoint",
    "FileProblem",
    "ObjectMismatch",
    "RangeCrc",
    "Repository",
    "announce_key",
    "cadence_key",
    "checkpoint_prefix",
    "chunk_ranges",
    "claim_key",
    "drill_claim_key",
    "drill_prefix",
    "drill_record_key",
    "is_withdrawal",
    "latest_key",
    "lease_checkpoint",
    "lease_is_fresh",
    "lease_prefix",
    "lease_why",
    "manifest_key",
    "notice_key",
    "object_key",
    "parse_notice_document",
    "part_key",
    "peer_key",
    "redirect_target",
    "run_prefix",
    "sharing_key",
    "withdrawn_why",
]
