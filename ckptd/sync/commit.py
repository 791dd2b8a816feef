"""Making a checkpoint visible, in the one order that keeps the store honest.

    1. objects   every file uploaded (or copied) and verified against the store's
                 report of size and checksum          (ckptd.sync.transfer)
    2. manifest  ckptd.manifest.json, by a conditional write (If-None-Match: *)
    3. LATEST    moved only forward in step

A crash between any two steps leaves either unreferenced objects (collected later; a
restart re-uses them) or a committed checkpoint that LATEST does not name yet (the
next commit, or ``ckptd restore``'s fallback to the newest manifest, covers that).
It never leaves a manifest naming an object that is not there, nor a LATEST naming a
checkpoint without a manifest. The conditional write makes a commit idempotent across
restarts and safe when two nodes race: exactly one write wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd import checksum
from ckptd.manifest import (
    Latest,
    Manifest,
    ManifestError,
    latest_key,
    manifest_key,
    parse_latest,
    parse_manifest,
    should_move_latest,
)
from ckptd.storage.base import (
    ConditionalWrite,
    NotFoundError,
    PreconditionFailedError,
    Storage,
    StorageError,
    require_capability,
)


class CommitConflictError(Exception):
    """A different manifest is already committed under this checkpoint's name."""


@dataclass(frozen=True)
class CommitResult:
    manifest_crc32c: str
    latest_moved: bool
    already_committed: bool


def _same_content(a: Manifest, b: Manifest) -> bool:
    return [(f.path, f.size, f.crc32c) for f in a.files] == [
        (f.path, f.size, f.crc32c) for f in b.files
    ]


def read_manifest(storage: Storage, run_id: str, checkpoint: str) -> Manifest | None:
    """The committed manifest of a checkpoint, or None if it is not committed."""
    try:
        return parse_manifest(storage.get_bytes(manifest_key(run_id, checkpoint)))
    except NotFoundError:
        return None


def read_latest(storage: Storage, run_id: str) -> Latest | None:
    """The run's LATEST pointer, or None if absent or unreadable."""
    try:
        return parse_latest(storage.get_bytes(latest_key(run_id)))
    except (NotFoundError, ManifestError):
        return None


def commit(storage: Storage, manifest: Manifest) -> CommitResult:
    """Steps 2 and 3 above; the caller has done step 1 for every file in ``manifest``."""
    # Without a conditional write two commits could both 'win': no commit at all, then.
    conditional = require_capability(storage, ConditionalWrite, "commit a checkpoint")
    body = manifest.to_bytes()
    crc = checksum.crc32c(body)
    already = False
    try:
        conditional.put_if_absent(
            manifest_key(manifest.run_id, manifest.checkpoint), body, crc32c=crc
        )
    except PreconditionFailedError:
        # Committed already: by us before a crash or a lost response, or by another node.
        existing = read_manifest(storage, manifest.run_id, manifest.checkpoint)
        if existing is None:
            raise StorageError(
                "manifest vanished after a failed conditional write", transient=True
            ) from None
        if not _same_content(existing, manifest):
            raise CommitConflictError(
                f"{manifest.run_id}/{manifest.checkpoint} is already committed with different content"
            ) from None
        crc = checksum.crc32c(storage.get_bytes(manifest_key(manifest.run_id, manifest.checkpoint)))
        already = True
    latest = read_latest(storage, manifest.run_id)
    moved = False
    if should_move_latest(latest, manifest.step):
        pointer = Latest(
            checkpoint=manifest.checkpoint, step=manifest.step, manifest_crc32c=checksum.to_hex(crc)
        )
        data = pointer.to_bytes()
        storage.put_bytes(latest_key(manifest.run_id), data, crc32c=checksum.crc32c(data))
        moved = True
    return CommitResult(checksum.to_hex(crc), moved, already)
