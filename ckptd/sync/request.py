"""One checkpoint to ship, as its completion rule saw it, and what tells its files apart.

``ShipRequest`` is what the pipeline hands the ``Shipper`` (``ckptd.sync.ship``): the
listing, the verdict, the trajectory its content belongs to, and (once claimed) the slot
it ships into. A file counts as sent only while it still has the identity it had when
read (``unchanged``); a checkpoint's files must not change while it ships
(``fingerprint``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ckptd.commit.assemble import ClusterShip
from ckptd.commit.single import Slot
from ckptd.core.manifest import ROOT_TRAJECTORY, Manifest, Parent, Trajectory
from ckptd.layouts.base import CheckpointListing, Completion, FileEntry
from ckptd.repository import object_key
from ckptd.sync.early import EarlyFile
from ckptd.sync.journal import ObjectRecord
from ckptd.sync.transfer import FileResult, TransferContext


@dataclass
class ShipRequest:
    """One checkpoint to ship, as its completion rule saw it."""

    run: str
    dir: Path
    listing: CheckpointListing
    verdict: Completion
    previous: Manifest | None
    context: TransferContext
    on_started: Callable[[int], None] = lambda total_bytes: None
    on_copied: Callable[[int], None] = lambda nbytes: None
    cluster: ClusterShip | None = None
    # Early uploads of this checkpoint (path -> the entry sent and its outcome), handed
    # over by ``EarlyUploads.take``: awaited, never started again.
    early: Mapping[str, EarlyFile] = field(default_factory=dict)
    # The trajectory its content belongs to and what the trainer resumed from
    # (``ckptd.sync.lineage``): they go into the manifest and choose its slot.
    trajectory: Trajectory = ROOT_TRAJECTORY
    parent: Parent | Literal["scratch"] | None = None
    # Where it ships (``ckptd.commit.slots``): set by the ship once claimed.
    slot: Slot | None = None
    # Called once step 0 is done (the slot claimed), before any object is sent: peer
    # replication starts there (``PipelineHooks.on_claimed``); what it returns, when not
    # None, is awaited before the first object goes (an emergency push goes first).
    on_claimed: Callable[[ShipRequest], Awaitable[None] | None] | None = None

    @property
    def name(self) -> str:
        return self.listing.name

    def key(self, path: str) -> str:
        """The object key of one of its files, in its slot."""
        assert self.slot is not None, "claimed before any object is sent"
        return object_key(self.run, self.slot.slot, path)


def unchanged(local: Path, record: ObjectRecord) -> bool:
    """Whether ``local`` still has the identity it had when ``record``'s object was read
    (size, mtime, and where recorded ctime and inode). Blocking (one stat)."""
    try:
        st = os.stat(local)
    except OSError:
        return False
    if record.ctime_ns == 0:  # recorded without (a copy, an older journal)
        return (st.st_size, st.st_mtime_ns) == (record.size, record.mtime_ns)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) == record.identity


def fingerprint(files: tuple[FileEntry, ...]) -> list[tuple[str, int, int]]:
    """What must not change while a checkpoint ships: each file's path, size, mtime."""
    return sorted((f.path, f.size, f.mtime_ns) for f in files)


def fingerprint_id(files: tuple[FileEntry, ...]) -> str:
    """``fingerprint`` as a short digest (16 hex), kept in the journal to tell a
    re-save under a committed or refused name from the files as they were then."""
    text = "".join(f"{p}\t{s}\t{m}\n" for p, s, m in fingerprint(files))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def local_path(request: ShipRequest, f: FileEntry | str) -> Path:
    """Where a file of the request's checkpoint lies (a checkpoint may be one file)."""
    path = f if isinstance(f, str) else f.path
    name = request.name
    return request.dir / name / path if request.listing.is_dir else request.dir / name


def sent_early_as(request: ShipRequest, f: FileEntry) -> bool:
    """Whether ``f`` was handed over from early shipping as it is now."""
    early = request.early.get(f.path)
    return early is not None and early[0] == f


def taken_early(f: FileEntry, early: FileResult) -> FileResult:
    """An early transfer's result as the ship reports it: a copy stays a copy (it is
    counted in ``ckptd_copied_bytes_total``), an upload is "early"."""
    how = "copied" if early.how == "copied" else "early"
    return FileResult(f.path, f.size, early.crc32c, how, early.bytes_sent, digest=early.digest)
