"""The store's reachability (and the run's peers'), read as a health event: lost for
longer than a set time.

Invariant: pure. Each reading (reachable or not) comes with the time it was taken; one
outage gives one event, when it has lasted ``threshold`` seconds, and the next only
after the store was reachable again.
"""

from __future__ import annotations

from ckptd.health.model import HealthEvent

SOURCE = "store"


class Reachability:
    """Since when the store has been unreachable, and whether this outage was reported."""

    def __init__(
        self,
        threshold: float,
        *,
        source: str = SOURCE,
        kind: str = "store-unreachable",
        what: str = "the store",
    ) -> None:
        self.threshold = threshold
        self.source, self.kind, self.what = source, kind, what
        self.lost_since: float | None = None
        self.reported = False

    def reading(self, reachable: bool, error: str, at: float) -> HealthEvent | None:
        """One reading; the degrading event once the outage is ``threshold`` long."""
        if reachable:
            self.lost_since, self.reported = None, False
            return None
        if self.lost_since is None:
            self.lost_since = at
        lost_for = at - self.lost_since
        if self.reported or lost_for < self.threshold:
            return None
        self.reported = True
        return HealthEvent(
            self.source,
            self.kind,
            "degrading",
            f"{self.what} has been unreachable for {lost_for:.0f} s: {error or 'no answer'}",
            at,
            {"lost_since": self.lost_since, "error": error},
        )

    @property
    def lost(self) -> bool:
        return self.lost_since is not None
