"""What peers say to each other: the offer, the replica, the announcement, the holdings.

Pure: models, identities and the rules that match what a peer holds to a manifest; no
I/O, no clock (times are arguments).

    Offer        the origin's first word (``POST /v1/peer/transfers``): which part of which
                 save, and every file's path and size, so the holder can check the paths
                 and reserve the bytes before one arrives
    Replica      the last word (``.../seal``): the same, with every file's CRC-32C (and
                 BLAKE3 digest, authenticated), which every received byte must match
                 before the holder acknowledges; kept beside the files as ``replica.json``
    replica_id   what an acknowledgement names: a digest of the save, the node and every
                 file's content, so an acknowledgement of another (a stale) save never
                 counts
    PeerAnnouncement  ``<run>/.ckptd-peers/node-<rank>.json``: where a daemon listens, its
                 failure domain and its free quota (``ckptd.peers.discovery``)
    Holding      one part a peer can serve a restore: a replica, or its own files

A replica holds one node's files of one save (with one node, the whole checkpoint):
exactly what the node's part in the store holds (``ckptd.commit.parts.Part``), so a holder
can write that part in the origin's name (``to_part``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ckptd.commit.parts import Part
from ckptd.core.digest import BLOCK
from ckptd.core.manifest import (
    ManifestError,
    ManifestFile,
    check_path_component,
    check_relative_path,
    utc_timestamp,
)

REPLICA_FORMAT = "ckptd.replica/1"
PEER_FORMAT = "ckptd.peer/1"
#: Bytes per chunk a file is sent in: each chunk is one request with its own CRC-32C, the
#: unit a dropped connection resends. A whole number of digest blocks (1 MiB), so each
#: chunk's block digests fold into the file's.
CHUNK_BYTES = 8 * BLOCK
#: Largest body of a JSON request or answer (an offer of 100k files fits).
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json", exclude_none=True)).encode()


class SizedFile(BaseModel):
    """A file as an offer names it: where it goes and how large it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    size: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _safe(cls, value: str) -> str:
        return check_relative_path(value)


class _PartOfSave(_Model):
    """Which part of which save: the fields an offer and its replica share."""

    format: str = REPLICA_FORMAT
    run_id: str
    checkpoint: str  # the slot the save ships into
    name: str  # the checkpoint's local name
    save: str  # the announced save (``ckptd.commit.parts.save_id``)
    node_rank: int = Field(ge=0)
    nodes: int = Field(ge=1)
    step: int | None
    layout: str
    writer: str  # the slot's claim writer (``cluster-<nodes>`` with many nodes)
    host: str  # the origin's host name
    peer: str  # the origin's peer id (its journal's writer id)
    address: str  # where the origin's peer port answers (host:port)
    created_at: str  # the origin's newest file's mtime, RFC 3339 UTC
    total_bytes: int = Field(ge=0)
    emergency: bool = False
    digest: str | None = None  # the digest algorithm the files carry (authenticated), if any

    @field_validator("format")
    @classmethod
    def _known(cls, value: str) -> str:
        if value != REPLICA_FORMAT:
            raise ValueError(f"unknown replica format {value!r}")
        return value

    @field_validator("run_id", "checkpoint", "name")
    @classmethod
    def _component(cls, value: str) -> str:
        return check_path_component(value)


def _no_path_twice(paths: Sequence[str]) -> None:
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            raise ValueError(f"{path!r} is listed twice")
        seen.add(path)
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise ValueError(f"{path!r} is under another file")


class Offer(_PartOfSave):
    """The origin's first word: every file's path and size."""

    files: list[SizedFile]

    @model_validator(mode="after")
    def _consistent(self) -> Offer:
        _no_path_twice([f.path for f in self.files])
        if self.total_bytes != sum(f.size for f in self.files):
            raise ValueError("total_bytes is not the sum of the files' sizes")
        return self


class Replica(_PartOfSave):
    """The last word, and what a holder keeps: every file's checksums."""

    files: list[ManifestFile]
    environment: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Replica:
        _no_path_twice([f.path for f in self.files])
        if self.total_bytes != sum(f.size for f in self.files):
            raise ValueError("total_bytes is not the sum of the files' sizes")
        return self

    def offer(self) -> Offer:
        """The offer that starts sending this replica."""
        doc = self.model_dump(mode="json", exclude={"files", "environment"})
        doc["files"] = [{"path": f.path, "size": f.size} for f in self.files]
        return Offer.model_validate(doc)

    def to_part(self, verified_at: float) -> Part:
        """The origin's part as the origin would have written it (``verified_at``: now)."""
        return Part(
            run_id=self.run_id,
            checkpoint=self.name,
            node_rank=self.node_rank,
            nodes=self.nodes,
            save=self.save,
            layout=self.layout,
            step=self.step,
            host=self.host,
            created_at=self.created_at,
            verified_at=utc_timestamp(verified_at),
            total_bytes=self.total_bytes,
            files=list(self.files),
            environment=dict(self.environment),
        )


def replica_id(replica: Replica) -> str:
    """What an acknowledgement names: 32 hex of SHA-256 over the save, the node and every
    file's content (module doc)."""
    doc = [
        REPLICA_FORMAT,
        replica.run_id,
        replica.checkpoint,
        replica.name,
        replica.save,
        replica.node_rank,
        replica.nodes,
        [(f.path, f.size, f.crc32c, f.digest) for f in replica.files],
    ]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def matches_offer(replica: Replica, offer: Offer) -> str | None:
    """Why a seal does not match the offer its transfer began with, or None."""
    if replica.offer().model_dump(exclude={"emergency"}) != offer.model_dump(exclude={"emergency"}):
        return "the replica names other files or another save than its offer"
    return None


def parse_offer(data: bytes) -> Offer:
    try:
        return Offer.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"invalid offer: {_first(exc)}") from None


def parse_replica(data: bytes) -> Replica:
    try:
        return Replica.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"invalid replica: {_first(exc)}") from None


def _first(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where}: {first['msg']}" if where else str(first["msg"])


def chunk_spans(size: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` of each chunk of a file of ``size`` bytes (none when empty)."""
    return [(start, min(chunk, size - start)) for start in range(0, size, chunk)]


# -- discovery -----------------------------------------------------------------------------


class PeerAnnouncement(_Model):
    """Where one daemon of a run takes replicas (``<run>/.ckptd-peers/node-<rank>.json``)."""

    format: str = PEER_FORMAT
    run_id: str
    node_rank: int = Field(ge=0)
    nodes: int = Field(ge=1)
    peer: str  # its journal's writer id: the same across restarts on one state dir
    incarnation: str  # new at each start of the daemon
    host: str
    address: str  # host:port its peer port answers on
    failure_domain: str = ""  # a zone or placement group; "" = unknown
    quota_bytes: int = Field(ge=0)
    free_bytes: int = Field(ge=0)
    updated_at: float  # Unix time of this write
    # Unix time until which this node has a notice of its own (a preemption, a drill):
    # never given another's part meanwhile (``placement``); None: no notice.
    notice_until: float | None = None
    started_at: float | None = None  # Unix time this daemon started

    @field_validator("format")
    @classmethod
    def _known(cls, value: str) -> str:
        if value != PEER_FORMAT:
            raise ValueError(f"unknown peer announcement format {value!r}")
        return value


def parse_peer_announcement(data: bytes) -> PeerAnnouncement | None:
    """The announcement ``data`` holds, or None when it is not one (never trusted)."""
    if len(data) > 64 * 1024:
        return None
    try:
        return PeerAnnouncement.model_validate_json(data)
    except ValidationError:
        return None


# -- restore: which holding serves which file ---------------------------------------------


class Holding(_Model):
    """One part a peer can serve: a replica it holds, or its own files (``kind``)."""

    id: str
    kind: Literal["replica", "own"]
    run_id: str
    checkpoint: str
    name: str
    save: str
    node_rank: int
    files: list[ManifestFile]


Route = tuple[str, str, int]
"""``(peer address, holding id, file index)``: where one file can be read from."""


def routes(
    wanted: Iterable[ManifestFile], offers: Mapping[str, Sequence[Holding]]
) -> dict[str, list[Route]]:
    """For each wanted file, every holding (by peer address) with the same content: the
    same path, size and CRC-32C, and the same digest where both name one. A holding of
    another save or step that differs in any file serves none of them."""
    out: dict[str, list[Route]] = {}
    by_content: dict[tuple[str, int, str], list[tuple[str, str, int, str | None]]] = {}
    for address, holdings in offers.items():
        for holding in holdings:
            for index, f in enumerate(holding.files):
                by_content.setdefault((f.path, f.size, f.crc32c), []).append(
                    (address, holding.id, index, f.digest)
                )
    for f in wanted:
        found = [
            (address, hid, index)
            for address, hid, index, dig in by_content.get((f.path, f.size, f.crc32c), [])
            if f.digest is None or dig is None or dig == f.digest
        ]
        if found:
            out[f.path] = found
    return out


__all__ = [
    "CHUNK_BYTES",
    "MAX_DOCUMENT_BYTES",
    "PEER_FORMAT",
    "REPLICA_FORMAT",
    "Holding",
    "Offer",
    "PeerAnnouncement",
    "Replica",
    "Route",
    "SizedFile",
    "chunk_spans",
    "matches_offer",
    "parse_offer",
    "parse_peer_announcement",
    "parse_replica",
    "replica_id",
    "routes",
]
