"""Reading what is in the store: committed checkpoints, and re-checking their bytes.

``verify_checkpoint`` is ckptd's ``restic check``: it re-reads every object named by a
manifest (ranges in parallel, CRC-32C folded with ``crc32c_combine``) and compares
sizes and checksums with what the manifest promised.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptd import checksum
from ckptd.manifest import Manifest, ManifestError, manifest_key, object_key
from ckptd.storage.base import NotFoundError, ShortObjectError, Storage
from ckptd.sync.commit import read_latest, read_manifest

READ_CHUNK = 16 * 1024 * 1024
# Manifest reads in flight while listing; within the S3 client's default connection pool.
LIST_CONCURRENCY = 8


@dataclass(frozen=True)
class CommittedCheckpoint:
    run_id: str
    manifest: Manifest
    is_latest: bool


def list_runs(storage: Storage) -> list[str]:
    return storage.list_children("")


def list_committed(
    storage: Storage, run_id: str, *, concurrency: int = LIST_CONCURRENCY
) -> list[CommittedCheckpoint]:
    """Committed checkpoints of a run, oldest first (by step, then commit time).

    One manifest GET per checkpoint, ``concurrency`` at a time: each is a small request
    whose time is the round trip, so a run with a thousand checkpoints lists in a
    fraction of the time one by one would take."""
    latest = read_latest(storage, run_id)

    def read(name: str) -> Manifest | None:
        try:
            return read_manifest(storage, run_id, name)
        except ManifestError:
            return None  # a manifest that does not parse is not a committed checkpoint

    names = storage.list_children(f"{run_id}/")
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        manifests = list(pool.map(read, names))
    found: list[CommittedCheckpoint] = []
    for name, manifest in zip(names, manifests, strict=True):
        if manifest is not None:
            found.append(
                CommittedCheckpoint(
                    run_id, manifest, latest is not None and latest.checkpoint == name
                )
            )
    found.sort(
        key=lambda c: (
            c.manifest.step if c.manifest.step is not None else -1,
            c.manifest.committed_at,
        )
    )
    return found


def resolve(storage: Storage, run_id: str, checkpoint: str | None) -> Manifest:
    """The manifest of ``checkpoint``, or with None the newest committed one: LATEST's,
    falling back to the newest manifest when LATEST is missing or names nothing committed."""
    if checkpoint is not None:
        manifest = read_manifest(storage, run_id, checkpoint)
        if manifest is None:
            raise NotFoundError(
                f"{run_id}/{checkpoint} is not committed (no {manifest_key(run_id, checkpoint)})"
            )
        return manifest
    latest = read_latest(storage, run_id)
    if latest is not None:
        try:
            manifest = read_manifest(storage, run_id, latest.checkpoint)
        except ManifestError:
            manifest = None
        if manifest is not None:
            return manifest
    committed = list_committed(storage, run_id)
    if not committed:
        raise NotFoundError(f"run {run_id!r} has no committed checkpoint")
    return committed[-1].manifest


@dataclass(frozen=True)
class FileProblem:
    path: str
    problem: str


def _crc_of_object(storage: Storage, key: str, size: int, pool: ThreadPoolExecutor) -> int:
    ranges = [(start, min(READ_CHUNK, size - start)) for start in range(0, size, READ_CHUNK)]

    def read(rng: tuple[int, int]) -> tuple[int, int]:
        crc = 0

        def fold(pos: int, piece: bytes) -> None:
            nonlocal crc
            crc = checksum.crc32c(piece, crc if pos else 0)  # a retry starts from pos 0

        storage.stream_range(key, rng[0], rng[1], fold)
        return crc, rng[1]

    return checksum.combine_parts(pool.map(read, ranges))


def verify_checkpoint(
    storage: Storage, manifest: Manifest, *, concurrency: int = 8
) -> list[FileProblem]:
    """Re-read every object of a committed checkpoint; the files that do not match."""
    problems: list[FileProblem] = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in manifest.files:
            key = object_key(manifest.run_id, manifest.checkpoint, f.path)
            info = storage.head(key)
            if info is None:
                problems.append(FileProblem(f.path, "missing"))
                continue
            if info.size != f.size:
                problems.append(FileProblem(f.path, f"size {info.size}, manifest says {f.size}"))
                continue
            try:
                crc = checksum.to_hex(_crc_of_object(storage, key, f.size, pool))
            except (ShortObjectError, NotFoundError) as exc:
                problems.append(FileProblem(f.path, str(exc)))
                continue
            if crc != f.crc32c:
                problems.append(FileProblem(f.path, f"crc32c {crc}, manifest says {f.crc32c}"))
    return problems


__all__ = [
    "CommittedCheckpoint",
    "FileProblem",
    "list_committed",
    "list_runs",
    "resolve",
    "verify_checkpoint",
]
