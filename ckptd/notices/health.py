"""Whether a notice source can hear its cloud: the last successful read, the failures
since, and the last error (``/v1/status``, ``ckptd status``, ``/readyz`` and the
``ckptd_notice_source_*`` metrics).

Invariant: a source is ``up`` only once one of its reads succeeded, and only while no
read key (the AWS token, each metadata item) has failed since its own last success. A
daemon that cannot hear its cloud therefore shows ``up = false`` from the first failed
poll on, whatever its logs are rate-limited to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: Failed reads in a row after which the source counts as deaf for ``/readyz``: one
#: lost poll is noise, three are an outage.
DEAF_AFTER_FAILURES = 3

# Keys whose failure does not make a source deaf (Azure's VM-name lookup: events are
# still read, each taken as ours).
NOT_DEAFENING = frozenset({"compute-name"})


class SourceHealth:
    """One notice source's health, fed by its reads (``failed`` / ``succeeded``)."""

    def __init__(self, source: str, wall: Callable[[], float] = time.time) -> None:
        self.source = source
        self._wall = wall
        self.last_success: float | None = None  # Unix time
        self.consecutive_failures = 0
        self.error = ""
        self._failing: set[str] = set()

    def failed(self, key: str, error: str) -> None:
        if key in NOT_DEAFENING:
            return
        self._failing.add(key)
        self.consecutive_failures += 1
        self.error = f"{key}: {error}"

    def succeeded(self, key: str) -> None:
        self._failing.discard(key)
        self._failing.discard("poll")  # an unexpected poll error ends with any success
        if not self._failing:
            self.consecutive_failures = 0
            self.error = ""
            self.last_success = self._wall()

    @property
    def up(self) -> bool:
        return self.last_success is not None and not self._failing

    @property
    def deaf(self) -> bool:
        """Failing for long enough that ``/readyz`` says so."""
        return not self.up and self.consecutive_failures >= DEAF_AFTER_FAILURES

    def to_json(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "last_success": self.last_success,
            "consecutive_failures": self.consecutive_failures,
            "error": self.error,
        }
