"""Custom trainers: a checkpoint is complete once its marker file appears at its root.

The marker (``COMPLETE`` by default, ``RuleSettings.marker``) is the trainer's own
statement that it is done, written last, so this rule adds no quiet window and no writer
check: a trainer may well keep a log file in the dir open, and the marker overrules it.
"""

from __future__ import annotations

from ckptd.layouts.base import CheckpointListing, Completion, RuleSettings, not_complete, shippable


class MarkerRule:
    """Any directory; complete when ``<marker>`` exists at its root."""

    name = "marker"

    def __init__(self, marker: str = RuleSettings.marker) -> None:
        # recognises() sees no settings, so auto builds one rule per configured marker.
        self.marker = marker

    def recognises(self, listing: CheckpointListing) -> bool:
        """A directory that already holds the marker (before that, auto falls back)."""
        return listing.is_dir and listing.has(self.marker)

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Complete when ``settings.marker`` is at the root beside at least one other file."""
        if not listing.is_dir:
            return not_complete(self.name, "not a directory (a marker needs one)")
        if not listing.files:
            return not_complete(self.name, "empty directory")
        if not listing.has(settings.marker):
            return not_complete(self.name, f"no {settings.marker} marker yet")
        if len(listing.files) == 1:
            return not_complete(self.name, f"only the {settings.marker} marker, nothing else")
        return Completion(
            complete=True,
            layout=self.name,
            reason=f"{settings.marker} marker present",
            files=shippable(listing),
        )
