"""``ckptd verify``: ckptd's ``restic check`` of one committed checkpoint.

Every object the manifest names is checked for presence and size from one listing,
then re-read in ranges (in parallel) and its CRC-32C, folded from the ranges', compared
with the manifest's; objects of one range (small files) many at a time. With ``keys`` (authenticated checkpoints) the manifest's signature
must hold first (``KeyRing.check`` raises AuthenticationError), and each object's
digest, from the same ranges (aligned to its 1 MiB blocks), must match the signed one.
Nothing is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from ckptd.core import checksum, digest
from ckptd.core.concurrency import lanes_for
from ckptd.core.manifest import Manifest, ManifestFile
from ckptd.core.signing import KeyRing
from ckptd.repository import (
    RANGE_BYTES,
    FileProblem,
    RangeCrc,
    Repository,
    chunk_ranges,
    object_key,
)
from ckptd.storage.base import NotFoundError, ShortObjectError, Storage

T = TypeVar("T")
# Small files checked per round of the lanes: the futures of 100,000 at once are memory.
_WINDOW = 1024


class _Inline(Executor):
    """Runs a small file's one range in the lane's own thread."""

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any], **_: Any) -> Iterator[T]:
        return map(fn, *iterables)


def _sums_of_object(
    storage: Storage, key: str, size: int, pool: Executor, range_bytes: int, digests: bool
) -> tuple[int, str | None]:
    """The CRC-32C of an object of ``size`` bytes, and its digest when ``digests``,
    from one read in ranges on ``pool``."""

    def read(rng: tuple[int, int]) -> tuple[int, int, list[bytes]]:
        crc, sums = RangeCrc(), digest.RangeDigest()

        def sink(pos: int, piece: bytes) -> None:
            crc.update(pos, piece)
            if digests:
                sums.update(pos, piece)

        storage.stream_range(key, rng[0], rng[1], sink)
        return crc.value, rng[1], sums.finish()

    results = list(pool.map(read, chunk_ranges(size, range_bytes)))
    crc = checksum.combine_parts((c, n) for c, n, _ in results)
    if not digests:
        return crc, None
    return crc, digest.file_digest(size, (b for _, _, blocks in results for b in blocks))


def verify_checkpoint(
    storage: Storage,
    manifest: Manifest,
    *,
    concurrency: int = 8,
    range_bytes: int = RANGE_BYTES,
    keys: KeyRing | None = None,
) -> list[FileProblem]:
    """Re-read every object of a committed checkpoint; the files that do not match.
    With ``keys``, an AuthenticationError first if the manifest's signature fails."""
    if keys is not None:
        keys.check(manifest)
        range_bytes = digest.aligned_chunk(range_bytes)
    repo = Repository(storage)
    problems = {
        m.path: FileProblem(
            m.path, "missing" if m.found is None else f"size {m.found}, manifest says {m.expected}"
        )
        for m in repo.object_mismatches(manifest)
    }
    digests = keys is not None

    def check(f: ManifestFile, pool: Executor) -> FileProblem | None:
        key = object_key(manifest.run_id, manifest.checkpoint, f.path)
        try:
            crc, found = _sums_of_object(storage, key, f.size, pool, range_bytes, digests)
        except (ShortObjectError, NotFoundError) as exc:
            return FileProblem(f.path, str(exc))
        if checksum.to_hex(crc) != f.crc32c:
            return FileProblem(f.path, f"crc32c {checksum.to_hex(crc)}, manifest says {f.crc32c}")
        if digests and found != f.digest:
            return FileProblem(
                f.path, "digest differs from the signed manifest's: the object was replaced"
            )
        return None

    todo = [f for f in manifest.files if f.path not in problems]
    # A file of one range is one GET: many of them at a time, as many as a restore
    # fetches (``ckptd.core.concurrency``), each read in its lane's own thread.
    small = [f for f in todo if f.size <= range_bytes]
    with ThreadPoolExecutor(max_workers=lanes_for(concurrency)) as lanes:
        inline = _Inline()
        for start in range(0, len(small), _WINDOW):
            window = small[start : start + _WINDOW]
            for problem in lanes.map(lambda f: check(f, inline), window):
                if problem is not None:
                    problems[problem.path] = problem
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in todo:
            if f.size > range_bytes and (problem := check(f, pool)) is not None:
                problems[f.path] = problem
    return [problems[f.path] for f in manifest.files if f.path in problems]


__all__ = ["FileProblem", "verify_checkpoint"]
