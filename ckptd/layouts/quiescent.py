"""The fallback: a checkpoint is complete once nothing has touched it for a while.

Knows nothing of any framework, so it asks for two things: no file changed within
``quiescence_seconds`` of now, and no process holding one of its files open for writing
(from ``/proc/*/fd``, when the scanner could tell). Both are needed: a trainer can pause
between files for longer than the window (say, gathering optimizer state), and a writer
can keep a file open without writing to it for a while.
"""

from __future__ import annotations

from ckptd.layouts.base import CheckpointListing, Completion, RuleSettings, settled


class QuiescentRule:
    """Any child; complete when quiet for ``quiescence_seconds`` with no writer."""

    name = "quiescent"

    def recognises(self, listing: CheckpointListing) -> bool:
        """Everything: this is the fallback."""
        return True

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Complete when at least one file exists, none is open for writing, and all are quiet."""
        return settled(
            self.name,
            listing,
            now_ns,
            settings.quiescence_seconds,
            f"quiet for {settings.quiescence_seconds:g}s, no writers",
        )
