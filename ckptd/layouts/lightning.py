"""PyTorch Lightning checkpoints: single ``*.ckpt`` files.

Write order (lightning/fabric/plugins/io/torch_io.py ``TorchCheckpointIO.save_checkpoint``
-> lightning/fabric/utilities/cloud_io.py ``_atomic_save``): ``torch.save`` into a BytesIO,
then ``with fs.transaction, fs.open(path, "wb")``. For a local path fsspec's
``LocalFileOpener`` writes to ``tempfile.mkstemp()`` (the system temp dir) and commits with
``shutil.move``: a rename when that is the same filesystem (the file appears whole), but a
``copy2`` into the final name when it is not, during which the file is visible, growing and
held open for writing. Hence: no writer and a short quiet window (``settle_seconds``).

``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symlink; the scanner does not
follow links, so it is never taken for data. Strategies that save a *directory* named
``*.ckpt`` (DeepSpeed) are not this rule's: they fall back to quiescence under ``auto``.
"""

from __future__ import annotations

from ckptd.layouts.base import (
    CheckpointListing,
    Completion,
    RuleSettings,
    not_complete,
    settled,
)

SUFFIX = ".ckpt"


class LightningRule:
    """One ``*.ckpt`` file written by Lightning."""

    name = "lightning"

    def recognises(self, listing: CheckpointListing) -> bool:
        """A regular file named ``*.ckpt``."""
        return not listing.is_dir and listing.name.endswith(SUFFIX)

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Complete when the file is non-empty, closed, and quiet for ``settle_seconds``."""
        if listing.is_dir:
            return not_complete(self.name, "a directory, not a single .ckpt file")
        if not listing.files:
            return not_complete(self.name, "file not there")
        if all(f.size == 0 for f in listing.files):
            # torch.save never produces an empty file: this is a write just begun.
            return not_complete(self.name, "empty file", recheck_after=settings.settle_seconds)
        return settled(
            self.name,
            listing,
            now_ns,
            settings.settle_seconds,
            f"closed and quiet for {settings.settle_seconds:g}s",
        )
