"""Which complete checkpoint ships next, and when a failed one may be tried again.

Pure: no I/O, no asyncio, no clock. Every method that needs the time takes it: ``now``
is monotonic seconds (backoff), ``wall`` is seconds since the epoch (sync lag).

The order is the one a preemption needs: an emergency checkpoint (completed after a
notice) before all others; then the highest step; then the most recently completed.
``ckptd run --once`` ships a backlog in the trainer's order instead (``next_in_step_order``:
an emergency checkpoint first, then the lowest step): it ships the whole backlog before it
exits, so the newest gains nothing by going first, and a lower step committed after a
higher one would read as a rollback (``latest_not_moved``) that never happened.
A checkpoint that failed waits ``min(cap, base * 2**(failures-1))`` seconds before it
is offered again. During an emergency an older upload in flight is paused unless it and
the emergency checkpoint can both finish before the deadline (``ckptd.sync.deadline``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ckptd.sync.deadline import may_finish_first

# A failed checkpoint is tried again after this backoff (doubling, capped), in seconds.
FAILURE_BACKOFF = (2.0, 300.0)
# A file's mtime may lag the notice by a little (the trainer started writing as the
# notice arrived, coarse mtime granularity): this much earlier still counts as "after".
EMERGENCY_MTIME_SLACK = 1.0


def completed_in_emergency(newest_mtime: float, emergency_since: float | None) -> bool:
    """Whether a checkpoint last written at wall time ``newest_mtime`` is the emergency
    save of a notice that arrived at wall time ``emergency_since`` (None: no notice)."""
    return emergency_since is not None and newest_mtime >= emergency_since - EMERGENCY_MTIME_SLACK


def backoff_delay(failures: int, backoff: tuple[float, float] = FAILURE_BACKOFF) -> float:
    """Seconds to wait after the ``failures``-th failure in a row (1-based)."""
    base, cap = backoff
    return float(min(cap, base * 2 ** (max(1, failures) - 1)))


@dataclass
class Pending:
    """A complete checkpoint waiting to be (or being) shipped."""

    run: str
    name: str
    step: int | None
    completed_at: float  # wall clock, for sync lag
    emergency: bool = False
    total_bytes: int = 0
    failures: int = 0
    not_before: float = 0.0  # monotonic; backoff after a failure

    def rank(self) -> tuple[int, int, float]:
        return (
            1 if self.emergency else 0,
            self.step if self.step is not None else -1,
            self.completed_at,
        )


@dataclass(frozen=True)
class InFlight:
    """An upload in progress, as the pause decision sees it."""

    run: str
    name: str
    total_bytes: int
    sent_bytes: int
    emergency: bool

    @property
    def bytes_left(self) -> int:
        return max(0, self.total_bytes - self.sent_bytes)


def uploads_to_pause(
    in_flight: Iterable[InFlight],
    emergency_bytes: int,
    rate_bytes_per_s: float | None,
    seconds_left: float | None,
) -> tuple[list[InFlight], list[InFlight]]:
    """``(pause, let finish)`` of the uploads in flight when an emergency checkpoint of
    ``emergency_bytes`` is ready: one that is itself an emergency upload is never paused;
    another finishes first only if both fit before the deadline at the measured rate."""
    pause: list[InFlight] = []
    keep: list[InFlight] = []
    for upload in in_flight:
        if upload.emergency:
            continue
        fits = may_finish_first(upload.bytes_left, emergency_bytes, rate_bytes_per_s, seconds_left)
        (keep if fits else pause).append(upload)
    return pause, keep


class ShipQueue:
    """The pending checkpoints of every run."""

    def __init__(self, backoff: tuple[float, float] = FAILURE_BACKOFF) -> None:
        self.backoff = backoff
        self._pending: dict[tuple[str, str], Pending] = {}

    def add(self, pending: Pending) -> bool:
        """Queue ``pending``; False (and nothing changes) if it is queued already."""
        key = (pending.run, pending.name)
        if key in self._pending:
            return False
        self._pending[key] = pending
        return True

    def get(self, run: str, name: str) -> Pending | None:
        return self._pending.get((run, name))

    def make_emergency(self, run: str, name: str) -> Pending | None:
        """The queued ``name``, counted from now on as the emergency checkpoint (a notice
        arrived just after it completed: ``completed_in_emergency``); None when it is not
        queued or counted so already."""
        pending = self._pending.get((run, name))
        if pending is None or pending.emergency:
            return None
        pending.emergency = True
        return pending

    def remove(self, run: str, name: str) -> Pending | None:
        return self._pending.pop((run, name), None)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[Pending]:
        return iter(list(self._pending.values()))

    def of_run(self, run: str) -> list[Pending]:
        return [p for p in self._pending.values() if p.run == run]

    def names(self, run: str) -> list[str]:
        return sorted(p.name for p in self.of_run(run))

    def next(self, now: float) -> Pending | None:
        """The checkpoint to ship now (module doc's order), skipping ones in backoff."""
        ready = [p for p in self._pending.values() if p.not_before <= now]
        return max(ready, key=Pending.rank, default=None)

    def next_in_step_order(self, now: float) -> Pending | None:
        """``run --once``'s checkpoint to ship now (module doc): an emergency one first,
        then the lowest step (a step-less one after every stepped one, as in ``next``),
        then the earliest completed; skipping ones in backoff."""
        ready = [p for p in self._pending.values() if p.not_before <= now]
        return min(
            ready,
            key=lambda p: (not p.emergency, p.step is None, p.step or 0, p.completed_at),
            default=None,
        )

    def next_wakeup(self, now: float) -> float | None:
        """Seconds until a checkpoint in backoff becomes ready; None when none waits."""
        times = [p.not_before for p in self._pending.values()]
        return None if not times else max(0.0, min(times) - now)

    def failed(self, pending: Pending, now: float) -> float:
        """Count a failure of ``pending`` and hold it back; returns the delay."""
        pending.failures += 1
        delay = backoff_delay(pending.failures, self.backoff)
        pending.not_before = now + delay
        return delay

    def retry_now(self) -> None:
        """End every backoff (the store came back): what failed is tried again now."""
        for pending in self._pending.values():
            pending.not_before = 0.0

    def sync_lag(self, run: str, wall: float) -> float:
        """Age of the run's oldest pending checkpoint (0 when none)."""
        oldest = min((p.completed_at for p in self.of_run(run)), default=None)
        return 0.0 if oldest is None else max(0.0, wall - oldest)

    def emergency_bytes(self) -> int:
        return sum(p.total_bytes for p in self._pending.values() if p.emergency)
