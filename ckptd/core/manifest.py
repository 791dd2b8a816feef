"""The manifest: what a committed checkpoint holds, and the rules a manifest must obey.

Pure: building, validating and (de)serialising; no I/O. ``ckptd.manifest.json`` is
written last (see ``ckptd.commit.single``): its presence is what "committed" means.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ckptd.core.errors import CkptdError

FORMAT = "ckptd.manifest/1"
MANIFEST_NAME = "ckptd.manifest.json"
LATEST_NAME = "LATEST"

_HEX8 = re.compile(r"^[0-9a-f]{8}$")


class ManifestError(CkptdError, ValueError):
    """A manifest (or LATEST pointer) that cannot be trusted (exit 1); the message says why.

    Also a ValueError, as it was before ``CkptdError`` existed: callers catch it as one."""


# C0 controls and DEL: S3 lists keys in XML 1.0, which cannot carry most of them, and a
# name with a newline breaks every line-oriented tool an operator points at the store.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def unstorable_name(path: str) -> str | None:
    """Why a local file's relative path cannot be a key faithfully, or None. A backslash
    is refused too: SeaweedFS (and Windows) read it as a '/', so ``a\\b`` would become
    ``a/b``; a name that is not UTF-8 (Python's surrogate escapes) has no key at all."""
    if "\\" in path:
        return "a backslash (stores read it as '/')"
    if _CONTROL.search(path):
        return "a control character"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "bytes that are not UTF-8"
    return None


def check_relative_path(path: str) -> str:
    """Return ``path`` if it is a safe relative '/'-path, else raise ManifestError."""
    if not path or path.startswith("/"):
        raise ManifestError(f"unsafe path {path!r}: must be relative and '/'-separated")
    problem = unstorable_name(path)
    if problem is not None:
        raise ManifestError(f"unsafe path {path!r}: it holds {problem}")
    if re.match(r"^[A-Za-z]:", path):
        raise ManifestError(f"unsafe path {path!r}: drive letters are not allowed")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ManifestError(f"unsafe path {path!r}: empty, '.' or '..' components")
    return path


def check_path_component(value: str) -> str:
    """Return ``value`` if it is one safe path component (a run id, a checkpoint name)."""
    check_relative_path(value)
    if "/" in value:
        raise ValueError(f"{value!r} must be a single path component")
    return value


class ManifestFile(BaseModel):
    """One file of a checkpoint."""

    model_config = ConfigDict(extra="allow", frozen=True)

    path: str
    size: int = Field(ge=0)
    crc32c: str
    # The file's cryptographic digest (``ckptd.core.digest``), hex; only in an authenticated
    # manifest (``[authentication]``), absent otherwise.
    digest: str | None = None

    @field_validator("path")
    @classmethod
    def _safe_path(cls, value: str) -> str:
        return check_relative_path(value)

    @field_validator("crc32c")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not _HEX8.match(value):
            raise ValueError(f"crc32c must be 8 lowercase hex digits, got {value!r}")
        return value


_LETTERS8 = re.compile(r"^[a-z]{8}$")


def check_trajectory_id(value: str) -> str:
    """A trajectory id: "" (the run's first trajectory) or 8 lowercase letters."""
    if value and not _LETTERS8.match(value):
        raise ValueError(f"a trajectory id is 8 lowercase letters, got {value!r}")
    return value


class ForkPoint(BaseModel):
    """Where a trajectory left another: the checkpoint it resumed from, by store name."""

    model_config = ConfigDict(extra="allow", frozen=True)

    checkpoint: str
    step: int | None
    trajectory: str

    _checkpoint = field_validator("checkpoint")(lambda cls, v: check_path_component(v))
    _trajectory = field_validator("trajectory")(lambda cls, v: check_trajectory_id(v))


class Trajectory(BaseModel):
    """The line of training a checkpoint belongs to (``ckptd.commit.lineage``): the run's
    first is id "" at generation 0; a trainer that resumed from an older checkpoint than
    the newest (a rollback), or from scratch, starts a new one, one generation above the
    one LATEST named then."""

    model_config = ConfigDict(extra="allow", frozen=True)

    id: str
    generation: int = Field(ge=0)
    # Where it forked (absent for the first trajectory and for one started from scratch).
    forked_from: ForkPoint | None = None
    from_scratch: bool | None = None

    _id = field_validator("id")(lambda cls, v: check_trajectory_id(v))

    def to_document(self) -> dict[str, object]:
        return self.model_dump(mode="json", exclude_none=True)


ROOT_TRAJECTORY = Trajectory(id="", generation=0)


class Parent(BaseModel):
    """The committed checkpoint the trainer resumed from, by store name."""

    model_config = ConfigDict(extra="allow", frozen=True)

    checkpoint: str
    step: int | None = None
    manifest_crc32c: str | None = None

    _checkpoint = field_validator("checkpoint")(lambda cls, v: check_path_component(v))


#: ``Manifest.parent`` of a trainer known to have started from scratch.
SCRATCH: Final = "scratch"


class Manifest(BaseModel):
    """``ckptd.manifest.json`` (docs/design.md, "Remote layout and manifest")."""

    model_config = ConfigDict(extra="allow", frozen=True)

    format: str = FORMAT
    run_id: str
    checkpoint: str
    step: int | None
    layout: str
    host: str
    created_at: str
    committed_at: str
    total_bytes: int = Field(ge=0)
    files: list[ManifestFile]
    environment: dict[str, str] = Field(default_factory=dict)
    # Many nodes (docs/design.md "Many nodes, one checkpoint"): how many nodes' parts this
    # manifest joins, and the save they all answered. Absent (None) on one node.
    nodes: int | None = Field(default=None, ge=1)
    save: str | None = None
    # Authenticated checkpoints (``ckptd.core.signing``): the files' digest algorithm,
    # the id of the key that signed, and the HMAC-SHA-256 (hex) over ``signable_bytes``.
    digest: str | None = None
    key_id: str | None = None
    signature: str | None = None
    # One name, one content, one trajectory (docs/design.md "Slots, claims and
    # trajectories"): the local name when the store name (``checkpoint``) differs from it;
    # the trajectory (absent: the run's first); the checkpoint the trainer resumed from
    # (absent: not known; "scratch": none).
    name: str | None = None
    trajectory: Trajectory | None = None
    parent: Parent | Literal["scratch"] | None = None
    # Saved after the trainer reported a non-finite loss (docs/health.md): why, in words;
    # absent otherwise. Older readers ignore it.
    suspect: str | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != FORMAT:
            raise ValueError(f"unknown manifest format {value!r} (expected {FORMAT!r})")
        return value

    @field_validator("checkpoint", "run_id")
    @classmethod
    def _one_component(cls, value: str) -> str:
        return check_path_component(value)

    @field_validator("name")
    @classmethod
    def _local_name(cls, value: str | None) -> str | None:
        return None if value is None else check_path_component(value)

    @property
    def local_name(self) -> str:
        """The name the checkpoint has in a watch dir (and a restore gives it)."""
        return self.name or self.checkpoint

    @property
    def lineage(self) -> Trajectory:
        """Its trajectory; the run's first when the manifest names none."""
        return self.trajectory or ROOT_TRAJECTORY

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        seen: set[str] = set()
        for f in self.files:
            if f.path in seen:
                raise ValueError(f"duplicate path {f.path!r}")
            seen.add(f.path)
        # A file that is also a directory of another file cannot be laid out on disk.
        for f in self.files:
            parts = f.path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in seen:
                    raise ValueError(f"path {f.path!r} lies under file {'/'.join(parts[:i])!r}")
        if sum(f.size for f in self.files) != self.total_bytes:
            raise ValueError("total_bytes differs from the sum of file sizes")
        return self

    def file_map(self) -> dict[str, ManifestFile]:
        return {f.path: f for f in self.files}

    def to_document(self) -> dict[str, object]:
        """The JSON document. The optional fields (many nodes, authentication, a file's
        digest) are left out when unset: a manifest without them stays as it was."""
        unset = {k for k in _OPTIONAL if getattr(self, k) is None}
        doc = self.model_dump(mode="json", exclude=unset)
        for entry in doc["files"]:
            if entry.get("digest", "") is None:
                del entry["digest"]
        for nested in ("trajectory", "parent"):
            if isinstance(doc.get(nested), dict):
                doc[nested] = {k: v for k, v in doc[nested].items() if v is not None}
        return doc

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_document(), indent=2, sort_keys=False) + "\n").encode()


_OPTIONAL = (
    *("nodes", "save", "digest", "key_id", "signature"),
    *("name", "trajectory", "parent", "suspect"),
)
SIGNATURE_DOMAIN = b"ckptd.manifest.signature/1\n"


def signable_bytes(manifest: Manifest) -> bytes:
    """What a manifest's signature covers: its document without ``signature``, as
    canonical JSON (sorted keys, no spaces, ASCII), after a domain prefix. Built from the
    parsed model, so every field the manifest holds (extra ones too) is covered, and a
    re-serialisation that keeps the values keeps the signature."""
    doc = manifest.to_document()
    doc.pop("signature", None)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return SIGNATURE_DOMAIN + canonical.encode()


def parse_manifest(data: bytes) -> Manifest:
    """Parse and validate; any defect is a ManifestError, never another exception."""
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "manifest"
        raise ManifestError(f"invalid manifest: {where}: {first['msg']}") from None


def utc_timestamp(epoch_seconds: float) -> str:
    """RFC 3339 UTC with a Z, second precision, as the manifest shows times."""
    return datetime.fromtimestamp(epoch_seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def epoch_of_timestamp(value: str) -> float | None:
    """``utc_timestamp``'s inverse (any RFC 3339 time); None for one that is not."""
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def build_manifest(
    *,
    run_id: str,
    checkpoint: str,
    step: int | None,
    layout: str,
    host: str,
    created_at: float,
    committed_at: float,
    files: Iterable[tuple[str, int, str]],
    environment: Mapping[str, str],
    nodes: int | None = None,
    save: str | None = None,
    digests: Mapping[str, str] | None = None,
    digest_algorithm: str | None = None,
    name: str | None = None,
    trajectory: Trajectory | None = None,
    parent: Parent | Literal["scratch"] | None = None,
    suspect: str | None = None,
) -> Manifest:
    """A manifest from ``(path, size, crc32c hex)`` triples; times are epoch seconds.
    ``digests`` (path -> hex, of ``digest_algorithm``) go with an authenticated one."""
    entries = sorted(files)
    found = digests or {}
    return Manifest(
        digest=digest_algorithm if digests is not None else None,
        nodes=nodes,
        save=save,
        run_id=run_id,
        checkpoint=checkpoint,
        step=step,
        layout=layout,
        host=host,
        created_at=utc_timestamp(created_at),
        committed_at=utc_timestamp(committed_at),
        total_bytes=sum(size for _, size, _ in entries),
        files=[ManifestFile(path=p, size=s, crc32c=c, digest=found.get(p)) for p, s, c in entries],
        environment=dict(environment),
        name=name if name is not None and name != checkpoint else None,
        trajectory=trajectory if trajectory is not None and trajectory != ROOT_TRAJECTORY else None,
        parent=parent,
        suspect=suspect or None,
    )


class Latest(BaseModel):
    """``<run>/LATEST``: the newest committed checkpoint of a run."""

    model_config = ConfigDict(extra="allow", frozen=True)

    checkpoint: str
    step: int | None
    manifest_crc32c: str
    # The trajectory of the checkpoint it names, and its generation (absent: the run's
    # first, 0): a commit moves LATEST only within it or to a newer generation.
    trajectory: str | None = None
    generation: int | None = None

    def to_bytes(self) -> bytes:
        doc = self.model_dump(mode="json")
        for optional in ("trajectory", "generation"):
            if doc.get(optional) is None:
                doc.pop(optional, None)
        return (json.dumps(doc) + "\n").encode()

    @property
    def lineage(self) -> tuple[str, int]:
        """``(trajectory id, generation)`` of what it names."""
        return self.trajectory or "", self.generation or 0


def parse_latest(data: bytes) -> Latest:
    try:
        return Latest.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"invalid LATEST: {exc.errors()[0]['msg']}") from None


def should_move_latest(current: Latest | None, step: int | None) -> bool:
    """LATEST never moves backwards in step; a step-less checkpoint moves it only when
    the current one is step-less too (commit order is then the only order known)."""
    if current is None:
        return True
    if step is None:
        return current.step is None
    return current.step is None or step >= current.step
