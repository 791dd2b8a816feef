"""A run that commits nothing: how long since its last commit (or since the daemon began
watching it), and what its watch dir held when last looked at, so that "the trainer
saves somewhere else" or "no completion rule ever holds" shows in ``/v1/status`` and in
``ckptd_seconds_without_commit`` (the CkptdNoCheckpoint alert).

Invariant: the quiet time never starts before the daemon did, so a fresh daemon on a
fresh run is not reported quiet for the time before it ran.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from pathlib import Path
from typing import Any

from ckptd.core.handoff import DIR as HANDOFF_DIR
from ckptd.runtime.metrics import Metrics

# Names shown of what the watch dir holds: enough to recognise a wrong layout.
SHOWN_ENTRIES = 5


def sight(watch_dir: Path) -> dict[str, Any]:
    """What ``watch_dir`` holds at its top level (blocking: call in a thread)."""
    try:
        entries = [e for e in watch_dir.iterdir() if e.name != str(HANDOFF_DIR)]
    except FileNotFoundError:
        return {"exists": False, "entries": 0, "newest": []}
    except OSError as exc:
        return {"exists": True, "error": str(exc), "entries": 0, "newest": []}
    dated = []
    for entry in entries:
        with contextlib.suppress(OSError):
            dated.append((entry.stat().st_mtime, entry.name))
    dated.sort(reverse=True)
    return {
        "exists": True,
        "entries": len(entries),
        "newest": [{"name": name, "mtime": mtime} for mtime, name in dated[:SHOWN_ENTRIES]],
    }


class QuietRuns:
    """Per run: when it last committed (as seen by this daemon) and its watch dir's sight."""

    def __init__(self, started: float) -> None:
        self.started = started
        self._last: dict[str, tuple[str, float]] = {}  # run -> (checkpoint, when)
        self.sights: dict[str, dict[str, Any]] = {}

    def observe(self, run: str, last_committed: dict[str, Any] | None, now: float) -> float:
        """Seconds ``run`` has gone without a commit, given its ``last_committed``."""
        if last_committed:
            name = str(last_committed.get("checkpoint"))
            seen = self._last.get(run)
            if seen is None or seen[0] != name:
                self._last[run] = (name, _when(last_committed.get("committed_at"), now))
        since = max(self.started, self._last[run][1] if run in self._last else self.started)
        return max(0.0, now - since)

    def annotate(self, runs: dict[str, dict[str, Any]], now: float, metrics: Metrics) -> None:
        """Add ``seconds_without_commit`` and ``watch_dir_seen`` to each run's status."""
        for run, doc in runs.items():
            quiet = self.observe(run, doc.get("last_committed"), now)
            doc["seconds_without_commit"] = round(quiet, 3)
            doc["watch_dir_seen"] = self.sights.get(run)
            metrics.seconds_without_commit.labels(run=run).set(quiet)


def _when(committed_at: Any, now: float) -> float:
    """``committed_at`` (ISO 8601) as Unix time; ``now`` when it cannot be read."""
    try:
        return min(
            now, datetime.fromisoformat(str(committed_at).replace("Z", "+00:00")).timestamp()
        )
    except ValueError:
        return now
