"""Making a checkpoint visible, in the one order that keeps the store honest.

    1. objects   every file uploaded (or copied) and verified against the store's
                 report of size and checksum          (ckptd.sync.transfer)
    2. manifest  ckptd.manifest.json, by a conditional write (If-None-Match: *)
    3. LATEST    moved only forward in step

A crash between any two steps leaves either unreferenced objects (collected later; a
restart re-uses them) or a committed checkpoint that LATEST does not name yet: the
restart that finds the manifest there runs step 3 for it (``move_latest``), since
``restore --latest`` follows LATEST and would otherwise resume from an older step.
It never leaves a manifest naming an object that is not there, nor a LATEST naming a
checkpoint without a manifest. The conditional write makes a commit idempotent across
restarts and safe when two nodes race: exactly one write wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.core import checksum
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import Latest, Manifest, parse_manifest, should_move_latest
from ckptd.storage.base import PreconditionFailedError, Storage, StorageError
from ckptd.store.repository import Repository


class CommitConflictError(CkptdError):
    """A different manifest is already committed under this checkpoint's name."""


@dataclass(frozen=True)
class CommitResult:
    manifest_crc32c: str
    latest_moved: bool
    already_committed: bool


def same_content(a: Manifest, b: Manifest) -> bool:
    """Whether two manifests name the same files with the same bytes."""
    return [(f.path, f.size, f.crc32c) for f in a.files] == [
        (f.path, f.size, f.crc32c) for f in b.files
    ]


def commit(storage: Storage | Repository, manifest: Manifest) -> CommitResult:
    """Steps 2 and 3 above; the caller has done step 1 for every file in ``manifest``."""
    repo = storage if isinstance(storage, Repository) else Repository(storage)
    body = manifest.to_bytes()
    crc = checksum.crc32c(body)
    already = False
    try:
        repo.put_manifest_if_absent(manifest, body, crc)
    except PreconditionFailedError:
        # Committed already: by us before a crash or a lost response, or by another node.
        stored = repo.read_manifest_bytes(manifest.run_id, manifest.checkpoint)
        if stored is None:
            raise StorageError(
                "manifest vanished after a failed conditional write", transient=True
            ) from None
        if not same_content(parse_manifest(stored), manifest):
            raise CommitConflictError(
                f"{manifest.run_id}/{manifest.checkpoint} is already committed with different content"
            ) from None
        crc = checksum.crc32c(stored)
        already = True
    moved = move_latest(repo, manifest, crc)
    return CommitResult(checksum.to_hex(crc), moved, already)


def move_latest(storage: Storage | Repository, manifest: Manifest, crc: int | None = None) -> bool:
    """Step 3 alone: point LATEST at ``manifest`` if that moves it forward in step;
    whether it moved. ``crc`` is the stored manifest's CRC-32C (read back when None).
    Also for a checkpoint found committed already: a crash between steps 2 and 3 left
    LATEST behind it."""
    repo = storage if isinstance(storage, Repository) else Repository(storage)
    if crc is None:
        stored = repo.read_manifest_bytes(manifest.run_id, manifest.checkpoint)
        if stored is None:
            return False
        crc = checksum.crc32c(stored)
    if not should_move_latest(repo.read_latest(manifest.run_id), manifest.step):
        return False
    pointer = Latest(
        checkpoint=manifest.checkpoint, step=manifest.step, manifest_crc32c=checksum.to_hex(crc)
    )
    repo.write_latest(manifest.run_id, pointer)
    return True
