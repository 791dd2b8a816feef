"""``ckptd run``'s part of the run ledger: the daemon beside a trainer it does not start (a
pod's sidecar, a systemd unit, a compose service) records from what it observes.

What it observes, per watched run, every ``POLL_SECONDS``:

- the trainer's processes: those ``trainer.pidfile`` or ``trainer.match`` finds (with one
  watched run; with several, a process cannot be told to a run, and each run's trainer is
  the process that reports its steps), and the process of the step counter's report.
  Their start times come from ``/proc/PID/stat`` (exact to a clock tick); their end is
  seen by polling (within ``POLL_SECONDS``). An attempt begins with the first process
  that started after the last attempt ended, and ends when the process that reports its
  steps is gone (or, before it reported, when all of its processes are);
- the step counter and the save reports in ``.ckptd/``, as ``ckptd exec`` reads them; the
  first step an attempt reports says where it resumed (``first_step - 1``: the helpers
  report every step), and so what the attempt before it lost;
- the restores ``ckptd restore`` recorded in the watch dir (``ckptd.goodput.restored``:
  a pod's init step, before this daemon started);
- notices (an attempt that ends while one is acted on ended on it, and the wait until its
  checkpoint is committed is ``wait_commit``) and commits.

A reporting process is known by its pid and its start (``pid_start`` in the report, the
same clock ticks /proc shows): a pid reused since, or another PID namespace's process
under the same number, is not the trainer.

What it cannot know, where ``ckptd exec`` does: a trainer's exit code (an attempt that
ends on a drill's notice is marked ``interrupted``, detail ``drill``, and its time until
the next attempt is the drill's; one that ends without a notice is marked ``interrupted``,
detail ``trainer-gone``, when the next
one starts; one that is never followed is marked by the next writer, and a finished run is
never marked ``finished``), a trainer that is not matched until it reports a step (one
that dies before is not seen), a trainer in another PID namespace, and one that reports
no steps and is not matched (nothing is recorded). docs/goodput.md says the same for
users.

Invariants: as ``ckptd.goodput.recorder``'s; reading /proc and ``.ckptd/`` never writes
anything but the ledger journal.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core.manifest import epoch_of_timestamp
from ckptd.goodput.model import Interval
from ckptd.goodput.recorder import GoodputRecorder
from ckptd.goodput.restored import RESTORED_RELPATH, read_restores
from ckptd.goodput.step_report import StepRecord, read_steps
from ckptd.notices.responder import find_trainer_pids
from ckptd.repository import Repository
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.processes import start_ticks

POLL_SECONDS = 0.25
SHIP_SECONDS = 15.0
# trainer.match reads every process's command line: this often at most.
WALK_SECONDS = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A process whose start is this close to an attempt's end started with it (clock ticks).
START_SLACK_SECONDS = 0.05

__all__ = ["POLL_SECONDS", "SHIP_SECONDS", "SidecarLedger", "process_started_at"]


def process_start(pid: int) -> tuple[int, float] | None:
    """``pid``'s start: its ``starttime`` in /proc/PID/stat (clock ticks since boot) and
    that as a Unix time; None when it is gone, a zombie or not visible."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return ticks, booted + ticks / CLK_TCK


def process_started_at(pid: int) -> float | None:
    """``pid``'s start as a Unix time, or None (``process_start``)."""
    found = process_start(pid)
    return None if found is None else found[1]


def reporter_start(report: StepRecord) -> float | None:
    """The start of the process that wrote ``report`` if it is alive and visible here:
    the pid's process, unless its start differs from the one the report carries (the pid
    reused since, or another PID namespace's process under the same number)."""
    found = process_start(report.pid) if report.pid > 0 else None
    if found is None or (report.pid_start and found[0] != report.pid_start):
        return None
    return found[1]


def same_process(one: StepRecord, other: StepRecord) -> bool:
    """Whether two reports are one process's: its pid, start and first report."""
    return (one.pid, one.pid_start, one.first_at) == (other.pid, other.pid_start, other.first_at)


@dataclass
class _Attempt:
    """The attempt this writer is recording: its processes and its reporting process."""

    started_at: float
    pids: dict[int, float] = field(default_factory=dict)  # pid -> its start
    reporter: int | None = None
    last: StepRecord | None = None  # its newest step report: the reporter's identity


@dataclass
class TrainerView:
    """Where the sidecar finds the trainer (``[trainer]``: ``pidfile``, ``match``), and
    how it learns of notices and commits (the daemon's)."""

    pidfile: str = ""
    match: str = ""
    emergency_committed: Callable[[], bool] = lambda: False
    last_committed: Callable[[], dict[str, Any] | None] = lambda: None
    # When the last drill's notice came (wall clock; None: no drill yet).
    drill_noticed: Callable[[], float | None] = lambda: None


class SidecarLedger:
    """One watched run's ledger as ``ckptd run`` beside its trainer sees it (module doc)."""

    def __init__(
        self,
        run_id: str,
        watch_dir: Path,
        repo: Repository,
        state_dir: Path,
        host: str,
        view: TrainerView,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.rec = GoodputRecorder(run_id, watch_dir, repo, state_dir, host, clock=clock)
        self.run_id, self.watch_dir, self.view, self.clock = run_id, watch_dir, view, clock
        self.current: _Attempt | None = None
        self.ended_at: float | None = None  # the last attempt's end
        self.undecided = False  # the last attempt ended without a notice, no successor yet
        self.noticed_at: float | None = None
        self.drill_began: float | None = None  # the drill the last attempt ended on
        self.flushed = False
        self.first_start = True  # no attempt began (nor was adopted) yet
        self.restores_seen: int | None = None  # the restore record's mtime, when read
        self.commit_seen: str | None = None
        self.walked_at = float("-inf")
        self.matched: list[int] = []

    async def start(self) -> None:
        """Read the run's ledger; whether its last attempt is over is decided at the first
        poll (a trainer still running is adopted, not taken for interrupted)."""
        await self.rec.load(gap=False, gone=None)

    # -- one look --------------------------------------------------------------------------

    def poll(self) -> None:
        """Look at the trainer, its reports, the restore record and the last commit."""
        now = self.clock.time()
        self._take_restore()
        reports = read_steps(self.watch_dir)
        alive = self._processes(reports.current, now)
        adopted = self.first_start and self._adopt(alive)
        if not adopted and self.current is not None and self._gone(alive):
            self._end(now, alive, reports)
        if self.current is None:
            self._begin(alive, reports.current)
        if self.current is not None:
            started = self.current.started_at - START_SLACK_SECONDS
            self.current.pids.update({p: s for p, s in alive.items() if s >= started})
            self._take(reports.current)
            self.rec.take_saves()
            self.rec.poll_spans()
        self._note_commit()
        if (
            self.noticed_at is not None
            and not self.flushed
            and self.current is None
            and self.view.emergency_committed()
        ):
            self._flushed(now)

    def _processes(self, report: StepRecord | None, now: float) -> dict[int, float]:
        """The trainer's live processes and their starts (module doc). ``trainer.match``
        walks /proc: at most every ``WALK_SECONDS`` while no trainer reports, then only
        when the reporting process is gone (its successor, started since, bounds its end)."""
        last = self.current.last if self.current is not None else None
        gone = last is not None and reporter_start(last) is None
        recent = now - self.walked_at < WALK_SECONDS
        if self.view.match and not gone and (recent or last is not None):
            pids = set(self.matched)
        else:
            self.walked_at = now
            self.matched = find_trainer_pids(self.view.pidfile, self.view.match)
            pids = set(self.matched)
        found = {}
        for pid in pids:
            started = process_started_at(pid)
            if started is not None:
                found[pid] = started
        # The reporting processes, when they are the ones that reported (not a reused pid).
        for known in (report, last):
            started = reporter_start(known) if known is not None else None
            if known is not None and started is not None:
                found[known.pid] = started
            elif known is not None and known is last:
                found.pop(known.pid, None)  # the reporter is gone, whoever has its pid now
        return found

    def _gone(self, alive: dict[int, float]) -> bool:
        assert self.current is not None
        if self.current.reporter is not None:
            return self.current.reporter not in alive
        return not (self.current.pids.keys() & alive.keys())

    def _begin(self, alive: dict[int, float], report: StepRecord | None) -> None:
        """A new attempt, with the processes that started after the last one ended, or the
        process whose first step report came after that (its start seen late: unmatched)."""
        after = self.ended_at if self.ended_at is not None else float("-inf")
        if self.first_start:
            after = max(after, self.rec.last_activity() or float("-inf"))
        new = {p: s for p, s in alive.items() if s > after - START_SLACK_SECONDS}
        if report is not None and report.pid in alive and report.first_at > after:
            new[report.pid] = alive[report.pid]  # the reporter itself: known alive above
        if not new:
            return
        start = min(new.values())
        if self.first_start:
            self.rec.previous_gone("writer-gone")
            self.rec.ledger_gap(start)
            self.rec.mark_at = start  # its time before is the gap's, or no part of the run
        else:
            if self.undecided:
                self.rec.exit_was("trainer-gone", interrupted=True)
                self.undecided = False
            if self.drill_began is not None:
                # From the drill's notice to the trainer started again: the drill's time.
                self.rec.interval("drill", self.drill_began, start, "drill")
                self.rec.mark_at = max(self.rec.mark_at, start)
                self.drill_began = None
            self.rec.restarting("process-restart", at=max(start, self.rec.mark_at))
        self.first_start = False
        self.rec.trainer_started(at=start, basis="process-start")
        self.current = _Attempt(start, dict(new))

    def _adopt(self, alive: dict[int, float]) -> bool:
        """At this writer's start: the last attempt's trainer (this node's, with no end
        marked) is still running if a live process started before that attempt's last
        record; go on recording it."""
        found = self.rec.unended_previous()
        if found is None or found[0] != self.rec.host:
            return False
        _, attempt, ended = found
        older = {p: s for p, s in alive.items() if s < ended}
        if not older:
            return False
        start = min(older.values())
        self.first_start = False
        self.rec.adopt(attempt, start)
        self.current = _Attempt(start, older)
        return True

    def _take(self, report: StepRecord | None) -> None:
        """This attempt's step report: its first says where it resumed."""
        current = self.current
        assert current is not None
        if report is None or report.first_at < current.started_at - START_SLACK_SECONDS:
            return
        if current.last is not None and not same_process(report, current.last):
            return
        first = self.rec.first_step is None
        if not self.rec.take_report(report):
            return
        current.reporter, current.last = report.pid, report
        if first:
            self.rec.resumed(report.first_step - 1)

    def _end(self, now: float, alive: dict[int, float], reports: Any) -> None:
        """The attempt's reporting process (or all of its processes) is gone."""
        current = self.current
        assert current is not None
        # Its last report: in the counter's first slot, or in its second when the next
        # trainer reported already.
        for report in (reports.current, reports.previous):
            if report is not None and current.last and same_process(report, current.last):
                self.rec.take_report(report)
        later = [s for p, s in alive.items() if p not in current.pids and s > current.started_at]
        ended = min([now, *later])
        if self.rec.samples:
            ended = max(ended, self.rec.samples[-1][0])
        self.rec.trainer_exited(at=ended, basis="process-start")
        self.current, self.ended_at = None, ended
        drill = self.view.drill_noticed()
        if self.noticed_at is not None:
            self.rec.exit_was(self.rec.notice_cause, interrupted=True)
        elif drill is not None and current.started_at <= drill <= ended:
            # A drill's notice stopped it: the drill's cost, not a trainer gone.
            self.rec.exit_was("drill", interrupted=True)
            self.drill_began = drill
        else:
            self.undecided = True

    # -- what the daemon tells ---------------------------------------------------------------

    def noticed(self, at: float, source: str) -> None:
        """A notice: the running attempt (if any) will end on it, and the wait for its
        checkpoint's commit after that is ``wait_commit``."""
        self.rec.noticed(at, source)
        if self.current is not None and self.noticed_at is None:
            self.noticed_at = at

    def _flushed(self, at: float) -> None:
        self.flushed = True
        self.rec.flushed(at)

    def _note_commit(self) -> None:
        last = self.view.last_committed() or {}
        name, at = last.get("checkpoint"), epoch_of_timestamp(last.get("committed_at") or "")
        new = isinstance(name, str) and name != self.commit_seen
        if new and at is not None and at >= self.rec.began:  # not one from before this start
            self.commit_seen = str(name)
            step = last.get("step")
            self.rec.mark(
                "commit", self.clock.time(), str(name), step if isinstance(step, int) else None
            )

    def _take_restore(self) -> None:
        """Each restore of this run into the watch dir, once: if it ended after the run's
        last record in the store and is not in the ledger yet (a later life of this
        daemon finds it there)."""
        try:
            changed = os.stat(self.watch_dir / RESTORED_RELPATH).st_mtime_ns
        except OSError:
            return
        if changed == self.restores_seen:
            return
        self.restores_seen = changed
        last = self.rec.last_activity(stored_only=True)
        known = {
            round(r.start, 2)
            for r in self.rec.records()
            if isinstance(r, Interval) and r.basis == "restore-record"
        }
        for record in read_restores(self.watch_dir, self.run_id):
            if last is not None and record.restored_at <= last:
                continue  # an older restore: the run has gone on since
            if round(record.began_at, 2) in known:
                continue
            self.rec.restored(record.began_at, record.restored_at, basis="restore-record")

    async def ship(self) -> None:
        await self.rec.ship()

    async def stop(self) -> None:
        """The daemon stops: an attempt a notice hit ends here if its trainer is still on
        its way out (the pod goes with the daemon), and so does the flush; mark the stop,
        ship."""
        now = self.clock.time()
        if self.noticed_at is not None and self.current is not None:
            self.rec.take_report(read_steps(self.watch_dir).current)
            self.rec.trainer_exited(at=now, basis="process-start")
            self.current, self.ended_at = None, now
            self.rec.exit_was(self.rec.notice_cause, interrupted=True)
        if self.noticed_at is not None and not self.flushed:
            self._flushed(now)
        self.rec.stopped("stop")
        await self.rec.ship()
