"""Orbax (JAX) checkpoints: ``<step>/`` directories.

Write order (orbax/checkpoint/_src/path/atomicity.py, ``CheckpointManager.save``): a save
goes into ``<step>.orbax-checkpoint-tmp-<timestamp>/`` and is finalised by renaming it to
``<step>/`` (``AtomicRenameTemporaryPath``): the rename is the commit. Where a rename is not
atomic (GCS, or ``CommitFileTemporaryPath``) orbax writes into ``<step>/`` directly and marks
the end with ``commit_success.txt`` (``ensure_atomic_save``). Older orbax versions also
wrote each item into its own ``<item>.orbax-checkpoint-tmp-<ts>/`` before renaming it.

So: a tmp suffix anywhere means not finalised; ``commit_success.txt`` means done; a plain
``<step>/`` is done too, after a short quiet window that costs a rename-finalised save at
most ``settle_seconds`` and keeps a commit-file save that lost its marker file from being
shipped mid-write.
"""

from __future__ import annotations

import re

from ckptd.layouts.base import (
    CheckpointListing,
    Completion,
    RuleSettings,
    basename,
    not_complete,
    settled,
)

TMP_MARKER = ".orbax-checkpoint-tmp"
COMMIT_SUCCESS = "commit_success.txt"
NAME = re.compile(r"\d+")
# Files orbax itself writes: step metadata, PyTree/OCDBT metadata, legacy sharding file.
_ORBAX_FILES = frozenset(
    {"_CHECKPOINT_METADATA", COMMIT_SUCCESS, "_METADATA", "_sharding", "manifest.ocdbt"}
)


class OrbaxRule:
    """``<step>/`` finalised by orbax's rename (or ``commit_success.txt``)."""

    name = "orbax"

    def recognises(self, listing: CheckpointListing) -> bool:
        """A ``<step>`` (or orbax tmp) dir holding orbax's own files, or beside orbax tmp dirs."""
        # A digits-only name alone is too common (custom trainers write "1000/" in place)
        # to be taken as committed on sight; those fall back to quiescence.
        if not listing.is_dir:
            return False
        if TMP_MARKER in listing.name:
            return True
        if NAME.fullmatch(listing.name) is None:
            return False
        return any(basename(f.path) in _ORBAX_FILES for f in listing.files) or any(
            TMP_MARKER in s for s in listing.siblings
        )

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Complete when finalised: renamed to plain ``<step>`` or marked ``commit_success.txt``."""
        if not listing.is_dir:
            return not_complete(self.name, "not a directory")
        if TMP_MARKER in listing.name:
            return not_complete(self.name, "still in orbax's tmp dir (the rename commits it)")
        if not listing.files:
            return not_complete(self.name, "empty directory")
        pending = next((f.path for f in listing.files if TMP_MARKER in f.path), None)
        if pending is not None:
            return not_complete(self.name, f"item not finalised: {pending}")
        if listing.has(COMMIT_SUCCESS):
            # Written after everything else; only a writer still at work can spoil it.
            return settled(self.name, listing, now_ns, 0.0, f"{COMMIT_SUCCESS} present")
        if NAME.fullmatch(listing.name) is None:
            return not_complete(self.name, "not a <step> directory")
        return settled(
            self.name, listing, now_ns, settings.settle_seconds, "finalised (renamed to <step>)"
        )
