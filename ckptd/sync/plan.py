"""What to send, copy server-side, or skip for one checkpoint. Pure.

A file may be skipped when the journal says this very file (same size and mtime) was
already uploaded and verified before a restart. A file whose size equals one in the
run's last committed checkpoint is a *copy candidate*: the pipeline checksums it first,
and if size and CRC-32C both match (a frozen base model beside LoRA adapters, say) the
store copies the old object instead of this node uploading it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptd.core.manifest import Manifest
from ckptd.layouts.base import FileEntry


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
    previous: Manifest | None,
    done: Mapping[str, tuple[int, int]],
) -> UploadPlan:
    """Split ``files``; ``done`` maps path -> (size, mtime_ns) of finished objects."""
    previous_sizes = {f.size for f in previous.files} if previous else set()
    upload: list[FileEntry] = []
    candidates: list[FileEntry] = []
    finished: list[FileEntry] = []
    for f in files:
        if done.get(f.path) == (f.size, f.mtime_ns):
            finished.append(f)
        elif f.size in previous_sizes and f.size > 0:
            candidates.append(f)
        else:
            upload.append(f)
    return UploadPlan(tuple(upload), tuple(candidates), tuple(finished))


def resolve_copies(
    candidates: Sequence[FileEntry], crcs: Mapping[str, str], previous: Manifest
) -> tuple[list[Copy], list[FileEntry]]:
    """Given each candidate's CRC-32C (hex), the copies to make and the files that
    must be uploaded after all. Same path is preferred when several old files match."""
    by_content: dict[tuple[int, str], str] = {}
    for old_file in previous.files:
        by_content.setdefault((old_file.size, old_file.crc32c), old_file.path)
    same_path = previous.file_map()
    copies: list[Copy] = []
    uploads: list[FileEntry] = []
    for f in candidates:
        crc = crcs[f.path]
        old = same_path.get(f.path)
        if old is not None and old.size == f.size and old.crc32c == crc:
            copies.append(Copy(f, f.path))
        elif (f.size, crc) in by_content:
            copies.append(Copy(f, by_content[(f.size, crc)]))
        else:
            uploads.append(f)
    return copies, uploads
