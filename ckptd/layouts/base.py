"""Types shared by every completion rule.

A completion rule is a pure function of a listing snapshot and a clock value: it opens
no file and reads no clock, so every framework's write order is a fast unit test.
The scanner (``ckptd.sync.scanner``) does the I/O and builds the snapshot.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

#: Small files that live beside the checkpoints (not inside one) and name the newest
#: complete one. The scanner reads their contents into ``CheckpointListing.trackers``.
TRACKER_FILES: tuple[str, ...] = ("latest", "latest_checkpointed_iteration.txt")

LAYOUT_NAMES: tuple[str, ...] = (
    "auto",
    "hf",
    "dcp",
    "deepspeed",
    "megatron",
    "lightning",
    "orbax",
    "marker",
    "quiescent",
)


@dataclass(frozen=True)
class FileEntry:
    """One regular file of a checkpoint, as stat() saw it."""

    path: str  # relative to the checkpoint root, '/'-separated; for a file checkpoint, its name
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class CheckpointListing:
    """A snapshot of one direct child of a watch dir, plus what lies beside it."""

    name: str  # the child's name: "checkpoint-500", "global_step10", "epoch=1-step=9.ckpt"
    is_dir: bool
    files: tuple[FileEntry, ...]
    # Contents (stripped) of the TRACKER_FILES present in the watch dir.
    trackers: Mapping[str, str] = field(default_factory=dict)
    # Names of all direct children of the watch dir (to see siblings such as orbax tmp dirs).
    siblings: frozenset[str] = frozenset()
    # Relative paths of files that some process holds open for writing (from /proc/*/fd);
    # None when that could not be determined.
    open_for_write: frozenset[str] | None = None
    # Entries that cannot be shipped as the trainer meant them: a dangling symlink, a
    # symlink to a directory (never followed: it may point at a whole dataset), a fifo.
    # (A symlink to a regular file is followed, as a copy would, and is among ``files``.)
    unshippable: tuple[str, ...] = ()
    # When the trainer's ckptd helper reported this save finished on every local rank
    # (``ckptd.core.saves.saved_at_ns``, ns since the epoch); None without such a report.
    saved_at_ns: int | None = None

    def has(self, path: str) -> bool:
        return any(f.path == path for f in self.files)

    @property
    def newest_mtime_ns(self) -> int:
        return max((f.mtime_ns for f in self.files), default=0)


@dataclass(frozen=True)
class RuleSettings:
    """Per-watch knobs that completion rules read."""

    quiescence_seconds: float = 10.0
    marker: str = "COMPLETE"
    # hf: trainer_state.json is written last, but a short quiet window guards against
    # a save that is still flushing other files (e.g. an async optimizer write).
    settle_seconds: float = 2.0


@dataclass(frozen=True)
class Completion:
    """The verdict of a completion rule on one listing."""

    complete: bool
    layout: str
    reason: str
    # The files to ship when complete (a rule may leave out scratch files).
    files: tuple[FileEntry, ...] = ()
    # When not complete only for want of time: evaluate again after this many seconds.
    recheck_after: float | None = None


class CompletionRule(Protocol):
    """One framework's notion of 'this checkpoint is complete'."""

    name: str

    def recognises(self, listing: CheckpointListing) -> bool:
        """True when the listing looks like this framework's checkpoint."""
        ...

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Decide completeness at wall-clock time ``now_ns`` (ns since the epoch)."""
        ...


_DIGITS = re.compile(r"\d+")


def step_of(name: str) -> int | None:
    """The step a checkpoint name carries: its last run of digits, or None."""
    runs = _DIGITS.findall(name)
    return int(runs[-1]) if runs else None


# --- Helpers shared by the rules (pure) -------------------------------------------------

#: Scratch files a framework writes while saving and never means to keep; no rule ships
#: them. torch.distributed.checkpoint's coordinator writes ``.metadata.tmp`` then renames it
#: (FileSystemWriter.finish); the HF/Kubeflow JIT-checkpoint callback creates
#: ``checkpoint-is-incomplete.txt`` before ``Trainer._save_checkpoint`` and removes it after.
SCRATCH_FILES: frozenset[str] = frozenset({".metadata.tmp", "checkpoint-is-incomplete.txt"})


def basename(path: str) -> str:
    """The last '/'-separated component of a relative path."""
    return path.rsplit("/", 1)[-1]


def shippable(listing: CheckpointListing) -> tuple[FileEntry, ...]:
    """The listing's files less the scratch files, in path order."""
    return tuple(
        sorted(
            (f for f in listing.files if basename(f.path) not in SCRATCH_FILES),
            key=lambda f: f.path,
        )
    )


def not_complete(layout: str, reason: str, recheck_after: float | None = None) -> Completion:
    """An 'incomplete' verdict."""
    return Completion(complete=False, layout=layout, reason=reason, recheck_after=recheck_after)


def settled(
    layout: str,
    listing: CheckpointListing,
    now_ns: int,
    window_seconds: float,
    reason: str,
) -> Completion:
    """Complete with ``reason`` once no file is held open for writing and none changed for
    ``window_seconds``; otherwise incomplete with a ``recheck_after`` hint."""
    if not listing.files:
        return not_complete(layout, "no files yet")
    # Closing a file is not a clock event, but the quiet window has to pass after it
    # anyway, so one window is the natural time to look again (never 0: no busy loop).
    window_hint = window_seconds if window_seconds > 0 else None
    writers = sorted(listing.open_for_write or ())
    if writers:
        return not_complete(
            layout, f"{len(writers)} file(s) being written, e.g. {writers[0]}", window_hint
        )
    if listing.saved_at_ns is not None and listing.newest_mtime_ns <= listing.saved_at_ns:
        # The window guesses when the trainer is done; here it said so, after every
        # file's last write (a file changed since then is a new save: wait as usual).
        return Completion(
            complete=True,
            layout=layout,
            reason="the trainer reported the save finished, no file changed since",
            files=shippable(listing),
        )
    age = (now_ns - listing.newest_mtime_ns) / 1e9
    if age < 0:
        # An mtime in the future (clock stepped back): wait a whole window, no more.
        return not_complete(layout, "newest file has an mtime in the future", window_hint)
    if age < window_seconds:
        return not_complete(
            layout,
            f"changed {age:.1f}s ago, waiting for {window_seconds:g}s of quiet",
            recheck_after=window_seconds - age,
        )
    return Completion(complete=True, layout=layout, reason=reason, files=shippable(listing))
