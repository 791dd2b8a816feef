"""``ckptd verify``: ckptd's ``restic check`` of one committed checkpoint.

Every object the manifest names is checked for presence and size from one listing,
then re-read in ranges (in parallel) and its CRC-32C, folded from the ranges', compared
with the manifest's. Nothing is written.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ckptd import checksum
from ckptd.manifest import Manifest
from ckptd.repository import RANGE_BYTES, FileProblem, Repository, object_key
from ckptd.storage.base import NotFoundError, ShortObjectError, Storage


def verify_checkpoint(
    storage: Storage, manifest: Manifest, *, concurrency: int = 8, range_bytes: int = RANGE_BYTES
) -> list[FileProblem]:
    """Re-read every object of a committed checkpoint; the files that do not match."""
    repo = Repository(storage)
    problems = {
        m.path: FileProblem(
            m.path, "missing" if m.found is None else f"size {m.found}, manifest says {m.expected}"
        )
        for m in repo.object_mismatches(manifest)
    }
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in manifest.files:
            if f.path in problems:
                continue
            key = object_key(manifest.run_id, manifest.checkpoint, f.path)
            try:
                crc = checksum.to_hex(
                    repo.crc_of_object(key, f.size, pool, range_bytes=range_bytes)
                )
            except (ShortObjectError, NotFoundError) as exc:
                problems[f.path] = FileProblem(f.path, str(exc))
                continue
            if crc != f.crc32c:
                problems[f.path] = FileProblem(f.path, f"crc32c {crc}, manifest says {f.crc32c}")
    return [problems[f.path] for f in manifest.files if f.path in problems]


__all__ = ["FileProblem", "verify_checkpoint"]
