"""What to send, copy server-side, or skip for one checkpoint. Pure.

A file may be skipped when the journal says this very file (same size and mtime) was
already uploaded and verified before a restart. A file whose size equals one in the
run's last committed checkpoint is a *copy candidate*: the pipeline checksums it first,
and if size and CRC-32C both match (a frozen base model beside LoRA adapters, say) the
store copies the old object instead of this node uploading it again. A file smaller than
``min_copy_size`` is never a candidate: one PUT (verified by its reply) is fewer requests
than a copy and its checks, and costs no more than reading it for its CRC-32C.

The previous manifest is indexed once (``CopySources``), so planning costs the same per
file whatever the number of files on either side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptd.core.manifest import Manifest
from ckptd.layouts.base import FileEntry


@dataclass(frozen=True)
class CopySources:
    """The previous checkpoint's files, indexed for ``plan_upload`` and ``resolve_copies``."""

    run_id: str
    checkpoint: str
    sizes: frozenset[int]
    by_content: Mapping[tuple[int, str], str]  # (size, crc32c) -> the first path with it
    by_path: Mapping[str, tuple[int, str]]  # path -> (size, crc32c)

    @classmethod
    def of(cls, manifest: Manifest) -> CopySources:
        by_content: dict[tuple[int, str], str] = {}
        for f in manifest.files:
            by_content.setdefault((f.size, f.crc32c), f.path)
        return cls(
            manifest.run_id,
            manifest.checkpoint,
            frozenset(f.size for f in manifest.files),
            by_content,
            {f.path: (f.size, f.crc32c) for f in manifest.files},
        )


def _sources(previous: Manifest | CopySources | None) -> CopySources | None:
    return CopySources.of(previous) if isinstance(previous, Manifest) else previous


@dataclass(frozen=True)
class UploadPlan:
    """The three kinds of work for a checkpoint's files."""

    upload: tuple[FileEntry, ...]
    copy_candidates: tuple[FileEntry, ...]
    done: tuple[FileEntry, ...]

    @property
    def bytes_to_upload(self) -> int:
        return sum(f.size for f in self.upload)


@dataclass(frozen=True)
class Copy:
    """A server-side copy from the previous checkpoint's object at ``source_path``."""

    file: FileEntry
    source_path: str


def plan_upload(
    files: Sequence[FileEntry],
    previous: Manifest | CopySources | None,
    done: Mapping[str, tuple[int, int]],
    *,
    min_copy_size: int = 1,
) -> UploadPlan:
    """Split ``files``; ``done`` maps path -> (size, mtime_ns) of finished objects."""
    sources = _sources(previous)
    previous_sizes = sources.sizes if sources is not None else frozenset()
    upload: list[FileEntry] = []
    candidates: list[FileEntry] = []
    finished: list[FileEntry] = []
    for f in files:
        if done.get(f.path) == (f.size, f.mtime_ns):
            finished.append(f)
        elif f.size in previous_sizes and f.size >= max(1, min_copy_size):
            candidates.append(f)
        else:
            upload.append(f)
    return UploadPlan(tuple(upload), tuple(candidates), tuple(finished))


def resolve_copies(
    candidates: Sequence[FileEntry], crcs: Mapping[str, str], previous: Manifest | CopySources
) -> tuple[list[Copy], list[FileEntry]]:
    """Given each candidate's CRC-32C (hex), the copies to make and the files that
    must be uploaded after all. Same path is preferred when several old files match."""
    sources = _sources(previous)
    assert sources is not None
    copies: list[Copy] = []
    uploads: list[FileEntry] = []
    for f in candidates:
        crc = crcs[f.path]
        if sources.by_path.get(f.path) == (f.size, crc):
            copies.append(Copy(f, f.path))
        elif (f.size, crc) in sources.by_content:
            copies.append(Copy(f, sources.by_content[(f.size, crc)]))
        else:
            uploads.append(f)
    return copies, uploads
