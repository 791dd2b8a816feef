"""Emergency mode: a preemption notice is being handled, or the daemon is flushing.

From the notice on (``enter_emergency``), a checkpoint completed since then goes first
(``ckptd.sync.queue``'s rules), the transfers take the urgent pool (``urgent``: no
waiting for an idle CPU), and the deadline decides whether an older upload in flight
may finish or is paused to make way (``make_way``; its finished parts stay in the
journal and it resumes afterwards). The seconds left and the measured rate give the
ETA that is logged and exported (``ckptd.sync.deadline``). This is the ``EmergencyMode``
the responder (``ckptd.notices.responder``) switches; it decides nothing itself: the
pure functions it calls do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics
from ckptd.sync.deadline import plan_flush
from ckptd.sync.early import EarlyUploads
from ckptd.sync.queue import InFlight, ShipQueue, uploads_to_pause
from ckptd.sync.rate import RateMeter
from ckptd.sync.runs import RunState
from ckptd.sync.transfer import TransferContext


class Emergency:
    """One pipeline's emergency mode (module doc)."""

    def __init__(
        self,
        runs: Mapping[str, RunState],
        queue: ShipQueue,
        early: EarlyUploads,
        rate: RateMeter,
        metrics: Metrics,
        clock: Clock,
        log: Any,
        *,
        look_again: Callable[[str, str, float], None],
        wake: Callable[[], None],
    ) -> None:
        self.runs = runs
        self.queue = queue
        self.early = early
        self.rate = rate
        self.metrics = metrics
        self.clock = clock
        self.log = log
        # The pipeline's ``hint`` (look at one checkpoint again after a delay) and a
        # nudge to its worker.
        self._look_again = look_again
        self._wake = wake
        # Since when (wall clock) and until when a notice is being handled.
        self.since: float | None = None
        self.deadline: datetime | None = None
        # The daemon is going away (SIGTERM): what it ships until then is urgent.
        self.flushing = False

    def watch_dirs(self) -> list[Path]:
        """Every watched run's directory (where the responder writes notice files)."""
        return [state.dir for state in self.runs.values()]

    def enter_emergency(self, deadline: datetime | None, since: float | None = None) -> None:
        """A notice arrived now (or at ``since``: one an earlier daemon acted on, carried
        over): what completes from then on goes first."""
        self.since = self.clock.time() if since is None else since
        self.deadline = deadline
        for state in self.runs.values():
            for name in state.seen - state.committed:
                self._look_again(state.run_id, name, 0.0)
        self._wake()

    def move_deadline(self, deadline: datetime | None) -> None:
        """The notice's deadline moved (restated by its source): the emergency keeps its
        start, so what was saved for it since stays its emergency checkpoint."""
        if self.since is not None:
            self.deadline = deadline
            self.update_eta()

    def leave_emergency(self) -> None:
        self.since = None
        self.deadline = None
        self.metrics.emergency_eta.set(0)

    def urgent(self) -> bool:
        """Whether what ships now must not wait for an idle CPU: a preemption notice is
        being handled, or the daemon is flushing before it goes (``flushing``)."""
        return self.since is not None or self.flushing

    def seconds_left(self) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline.timestamp() - self.clock.time()

    def in_flight(self) -> list[tuple[InFlight, TransferContext]]:
        """Every upload in flight (early ones included), with how to pause it."""
        found = self.early.in_flight()
        for state in self.runs.values():
            current, ctx = state.current, state.current_ctx
            if current is None or ctx is None:
                continue
            pending = self.queue.get(state.run_id, current.name)
            upload = InFlight(
                state.run_id,
                current.name,
                current.total_bytes,
                current.sent_bytes,
                emergency=pending is not None and pending.emergency,
            )
            found.append((upload, ctx))
        return found

    def make_way(self, emergency_bytes: int) -> None:
        """Pause an older upload in flight unless both can finish before the deadline;
        its finished parts stay in the journal and it resumes afterwards."""
        in_flight = self.in_flight()
        pause, keep = uploads_to_pause(
            [u for u, _ in in_flight], emergency_bytes, self.rate.rate(), self.seconds_left()
        )
        for u in keep:
            self.log.info(
                "older_upload_continues", run=u.run, checkpoint=u.name, bytes_left=u.bytes_left
            )
        for u, ctx in in_flight:
            if u in pause:
                self.log.warning(
                    "older_upload_paused", run=u.run, checkpoint=u.name, bytes_left=u.bytes_left
                )
                ctx.pause.set()
        self.update_eta()

    def update_eta(self) -> None:
        """Log and export when the emergency work will be committed at the measured rate."""
        if self.since is None:
            return
        left = self.queue.emergency_bytes() - sum(
            u.sent_bytes for u, _ in self.in_flight() if u.emergency
        )
        plan = plan_flush(max(0, left), self.rate.rate(), self.seconds_left())
        if plan.eta_seconds is not None:
            self.metrics.emergency_eta.set(plan.eta_seconds)
        if plan.will_make_it is False:
            self.log.warning(
                "emergency_flush_at_risk",
                eta_seconds=round(plan.eta_seconds or 0, 1),
                seconds_left=plan.seconds_left,
            )
