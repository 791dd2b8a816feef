"""A writer's part of the run ledger: turns what a daemon sees of its trainer (the restore,
each trainer start and end, the trainer's step and save reports, a notice and its flush,
its own stop) into ledger records (``ckptd.goodput.model``), journals them locally and
ships them to the store. ``ckptd exec`` drives it from its child (``ckptd.supervision``);
``ckptd run`` beside the trainer from what it observes (``ckptd.goodput.sidecar``).

Invariants:
- A record counts once journaled (``ckptd.goodput.journal``: fsync'd locally, then
  shipped; a record shipped twice counts once). A kill -9 before a record is journaled
  loses at most the open productive span (closed every ``SPAN_SECONDS``): the next life on
  this node takes it from the step counter the trainer left in the watch dir; on another
  node it reads as down (``ledger-gap``), never as productive.
- Time is the wall clock (``Clock.time``), as the trainer's reports are.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from ckptd.core import saves
from ckptd.goodput.journal import LedgerJournal, read_ledger
from ckptd.goodput.model import (
    Goodput,
    Interval,
    Mark,
    Record,
    goodput,
    is_trainer_attempt,
    lost_span,
    merge_records,
    notice_cause,
    span,
)
from ckptd.goodput.step_report import StepRecord, read_steps
from ckptd.repository import Repository
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.logs import get_logger
from ckptd.storage.base import StorageError

__all__ = ["SPAN_SECONDS", "GoodputRecorder", "read_ledger"]

# A productive span is closed (journaled) at least this often.
SPAN_SECONDS = 10.0
# A summary with no new record since is made again after this long at most.
SUMMARY_SECONDS = 5.0


def previous_attempt(
    records: list[Record], host: str, *, trainers_only: bool = False
) -> tuple[str, str, float] | None:
    """The node, attempt and end of the run's last attempt in ``records`` (that of
    ``host``'s rank, with many nodes: ``host`` is ``<name>#<rank>``); with
    ``trainers_only``, its last trainer start (a writer killed before it started one
    trained nothing, so the progress lost is still that trainer's)."""
    intervals = [
        r
        for r in records
        if isinstance(r, Interval) and (not trainers_only or is_trainer_attempt(r.attempt))
    ]
    if "#" in host:
        rank = host.rsplit("#", 1)[1]
        intervals = [r for r in intervals if r.node.endswith(f"#{rank}")] or intervals
    if not intervals:
        return None
    last = max(intervals, key=lambda r: r.end)
    ended = max(r.end for r in intervals if r.attempt == last.attempt)
    return last.node, last.attempt, ended


def step_samples(records: list[Record], attempt: str) -> list[tuple[float, int]]:
    """``(time, step)`` at each end of ``attempt``'s productive spans, in time order."""
    return sorted(
        sample
        for r in records
        if isinstance(r, Interval)
        and r.cause == "productive"
        and r.attempt == attempt
        and r.step_from is not None
        and r.step_to is not None
        for sample in ((r.start, r.step_from), (r.end, r.step_to))
    )


class GoodputRecorder:
    """One writer's part of the run ledger (module doc)."""

    def __init__(
        self,
        run_id: str,
        watch_dir: Path,
        repo: Repository,
        state_dir: Path,
        host: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.run_id, self.watch_dir, self.repo, self.host = run_id, watch_dir, repo, host
        self.clock = clock
        self.log = get_logger(run=run_id)
        self.writer = f"{host}-{uuid.uuid4().hex[:8]}"
        # The cause of an attempt the last notice ends: ``health`` for a health stop's.
        self.notice_cause = "notice"
        self.journal = LedgerJournal(run_id, self.writer, repo, state_dir)
        self.stored: list[Record] = []  # the store's ledger as read at start-up
        self.attempt = self.writer
        self.starts = 0
        self.began = clock.time()
        self.mark_at = self.began  # the end of what is recorded on this node so far
        self.trainer_started_at: float | None = None
        self.first_step_at: float | None = None
        self.samples: list[tuple[float, int]] = []  # this attempt's (time, step)
        self.span_from: tuple[float, int] | None = None
        self.exited_at: float | None = None  # the last trainer's exit
        self.done_at: float | None = None  # where a normal exit's work ended
        self.saved_at = 0.0  # the end of this writer's newest save report
        # The last attempt that ended, until the next one says where it resumed:
        # its samples, its end, its id.
        self.ended: tuple[list[tuple[float, int]], float, str] | None = None
        self.resolved_store = False  # the store's last attempt's loss is accounted for
        self.summaries: dict[bool, tuple[tuple[bool, int, int], float, Goodput]] = {}
        self.saves_seen = 0.0  # the newest save report taken (its ``at``)

    # -- records ---------------------------------------------------------------------

    def _id(self) -> str:
        return self.journal.next_id()

    def _append(self, record: Record) -> None:
        self.journal.append(record)

    def interval(self, cause: str, start: float, end: float, basis: str, **kw: Any) -> None:
        if end > start:
            self._append(
                Interval(self._id(), self.host, self.attempt, cause, start, end, basis, **kw)
            )

    def mark(self, kind: str, at: float, detail: str = "", step: int | None = None) -> None:
        self._append(Mark(self._id(), self.host, self.attempt, kind, at, detail, step))

    async def ship(self) -> None:
        await self.journal.ship()

    # -- what the writer sees ------------------------------------------------------------

    async def load(self, *, gap: bool = True, gone: str | None = "exec-gone") -> None:
        """Ship what an earlier life of this node left unshipped, read the store's ledger,
        record the down time since the run's last record there (``gap``: a fresh node or a
        restarted writer, from the interruption to this start), and mark the last attempt
        interrupted (detail ``gone``) if nothing marked its end (None: the caller decides,
        ``previous_gone``)."""
        now = self.clock.time()
        await self.ship()
        try:
            self.stored = await asyncio.to_thread(read_ledger, self.repo, self.run_id)
        except StorageError as exc:
            self.log.warning("goodput_ledger_unreadable", error=str(exc))
        self.mark_at = now
        if gap:
            self.ledger_gap(now)
        if gone is not None:
            self.previous_gone(gone)

    def unended_previous(self) -> tuple[str, str, float] | None:
        """The run's last attempt before this writer (node, attempt, end) when nothing
        marked how it ended; None otherwise."""
        previous = self._previous()
        if previous is None or self.run_finished():
            return None
        attempt = previous[1]
        ends = {"interrupted", "finished"}
        if any(
            isinstance(r, Mark) and r.kind in ends and r.attempt == attempt for r in self.stored
        ):
            return None
        return previous

    def previous_gone(self, detail: str) -> None:
        """The last attempt's writer died with it (kill -9, the node lost): no one marked
        its end. On this node its trainer's last step report is still in the watch dir."""
        found = self.unended_previous()
        if found is not None:
            node, attempt, ended = found
            ended = self._left_behind(node, attempt, ended)
            steps = [
                r.step_to
                for r in self.records()
                if isinstance(r, Interval) and r.attempt == attempt and r.step_to is not None
            ]
            last = max(steps) if steps else None
            self._append(Mark(self._id(), node, attempt, "interrupted", ended, detail, last))

    def adopt(self, attempt: str, started_at: float) -> None:
        """The trainer of ``attempt`` (the previous writer's on this node) still runs: this
        writer restarted beside it and goes on recording that attempt from where its
        journaled training ended."""
        spans = [
            r
            for r in self.records()
            if isinstance(r, Interval)
            and r.attempt == attempt
            and r.cause == "productive"
            and r.step_to is not None
        ]
        self.attempt = attempt
        self.trainer_started_at = started_at
        self.resolved_store = True  # where it resumed was resolved when it started
        self.samples, self.span_from, self.first_step_at = [], None, None
        if spans:
            last = max(spans, key=lambda r: r.end)
            assert last.step_to is not None
            self.span_from = (last.end, last.step_to)
            self.samples, self.first_step_at = [self.span_from], started_at
            self.mark_at = max(self.mark_at, last.end)

    def last_activity(self, *, stored_only: bool = False) -> float | None:
        """The last instant of the run recorded (in the store as read at the start, or with
        this writer's records too); None: none."""
        bounds = span(self.stored if stored_only else self.records())
        return None if bounds is None else bounds[1]

    def ledger_gap(self, until: float) -> None:
        """The run was down from its last record in the store until ``until`` (this writer
        taking it up), unless it had finished."""
        last = self.last_activity(stored_only=True)
        if last is not None and last < until and not self.run_finished():
            self.interval("down", last, until, "ledger-gap")

    def run_finished(self) -> bool:
        return any(isinstance(r, Mark) and r.kind == "finished" for r in self.stored)

    def restored(
        self,
        start: float,
        end: float,
        basis: str = "exec-restore",
        *,
        sources: tuple[int, int] | None = None,
    ) -> None:
        """The restore before the first start; ``sources``: its (peer, store) bytes."""
        if basis == "exec-restore":
            self.interval("startup", self.mark_at, start, "exec-start")
        peer, store = sources if sources is not None else (None, None)
        self.interval("restore", start, end, basis, peer_bytes=peer, store_bytes=store)
        self.mark_at = max(self.mark_at, end)

    def _left_behind(self, node: str, attempt: str, ended: float) -> float:
        """The training a dead writer's trainer did after its last journaled span, from its
        step counter left in this node's watch dir (node = this host); the attempt's end."""
        doc = read_steps(self.watch_dir).current
        if node != self.host or doc is None or doc.at <= ended:
            return ended
        spans = [
            r
            for r in self.stored
            if isinstance(r, Interval) and r.attempt == attempt and r.cause == "productive"
        ]
        if spans and spans[-1].step_to is not None:
            start, first = spans[-1].end, spans[-1].step_to
        else:
            start, first = doc.first_at, doc.first_step
        if start >= doc.at or first > doc.step:
            return ended
        self._append(
            Interval(
                self._id(),
                node,
                attempt,
                "productive",
                start,
                doc.at,
                "step-report-left",
                first,
                doc.step,
            )
        )
        return doc.at

    def _previous(self) -> tuple[str, str, float] | None:
        return previous_attempt(self.stored, self.host)

    def _lost_before(self, step: int) -> None:
        """Progress the previous trainer (the store's ledger) made past ``step``, where
        this writer's first trainer resumes, is lost."""
        records = self.records()  # the store's, and what load() added from this node
        previous = previous_attempt(records, self.host, trainers_only=True)
        if previous is None:
            return
        node, attempt, ended = previous
        ended = max(
            [ended, *(r.end for r in records if isinstance(r, Interval) and r.attempt == attempt)]
        )
        self._lost(step_samples(records, attempt), step, ended, node, attempt)

    def _lost(
        self, samples: list[tuple[float, int]], step: int, ended: float, node: str, attempt: str
    ) -> None:
        found = lost_span(samples, step, ended)
        if found is None:
            return
        since, lo, hi = found
        self._append(
            Interval(self._id(), node, attempt, "lost", since, ended, "step-report", lo, hi)
        )

    def resumed(self, step: int | None) -> None:
        """The trainer (re)started from ``step`` (None: from scratch): what the attempt
        before it did past that step is lost (this writer's last attempt, else, for its
        first, the store's last)."""
        if self.ended is not None and self.ended[0]:
            samples, ended_at, attempt = self.ended
            self._lost(samples, step or 0, ended_at, self.host, attempt)
        elif not self.resolved_store:  # no attempt of this writer trained yet
            self._lost_before(step or 0)
        self.ended = None
        self.resolved_store = True

    def restarting(self, basis: str = "exec-restart", at: float | None = None) -> None:
        """The wait from the last attempt's end until the next start (``at``, else now)
        is down time."""
        now = self.clock.time() if at is None else at
        self.interval("down", self.mark_at, now, basis)
        self.mark_at = max(self.mark_at, now)

    def trainer_started(self, *, at: float | None = None, basis: str = "exec-start") -> None:
        """A trainer started (at ``at``, else now): a new attempt; its start-up runs from
        the writer's last recorded instant (exec: its own start, the restore's end)."""
        now = self.clock.time() if at is None else at
        self.starts += 1
        self.attempt = f"{self.writer}/{self.starts}"
        self.interval("startup", self.mark_at, now, basis)
        self.trainer_started_at = now
        self.mark_at = max(self.mark_at, now)
        self.first_step_at = None
        self.samples, self.span_from = [], None

    def exec_started(self, step: int | None) -> None:
        """``ckptd exec`` started its trainer, resuming from ``step`` (None: from scratch)."""
        if self.starts:
            self.restarting()
        self.resumed(step)
        self.trainer_started()

    def take_report(self, report: StepRecord | None) -> bool:
        """Take a step report of this attempt's trainer (one whose first step came after
        the attempt started); False when it is not one."""
        if self.trainer_started_at is None or report is None:
            return False
        if report.first_at < self.trainer_started_at or report.at < report.first_at:
            return False
        if self.first_step_at is None:
            self.first_step_at = report.first_at
            self.interval("startup", self.trainer_started_at, report.first_at, "step-report")
            self.span_from = (report.first_at, report.first_step)
            self.samples.append(self.span_from)
            self.mark_at = max(self.mark_at, report.first_at)
        if (report.at, report.step) != self.samples[-1] and report.at >= self.samples[-1][0]:
            self.samples.append((report.at, report.step))
        return True

    @property
    def first_step(self) -> int | None:
        """The first step this attempt's trainer reported (None: none yet)."""
        return self.samples[0][1] if self.samples else None

    def poll(self) -> None:
        """Take the trainer's newest step and save reports; close the productive span when
        it is ``SPAN_SECONDS`` old."""
        if self.trainer_started_at is None:
            return
        self.take_report(read_steps(self.watch_dir).current)
        self.take_saves()
        self.poll_spans()

    def poll_spans(self) -> None:
        """Close the productive span when it is ``SPAN_SECONDS`` old."""
        if (
            self.span_from is not None
            and self.samples
            and self.samples[-1][0] - self.span_from[0] >= SPAN_SECONDS
        ):
            self._close_span(*self.samples[-1])

    def take_saves(self) -> None:
        """The trainer's save reports since the last look (this attempt's)."""
        for report in saves.read_reports(self.watch_dir):
            when, seconds = report.get("at"), report.get("save_seconds")
            if not isinstance(when, int | float) or when <= self.saves_seen:
                continue
            self.saves_seen = float(when)
            started = self.trainer_started_at
            if isinstance(seconds, int | float) and started is not None and when >= started:
                self.interval("save", float(when) - seconds, float(when), "trainer")
                self.saved_at = float(when)

    def _close_span(self, at: float, step: int) -> None:
        assert self.span_from is not None
        start, first = self.span_from
        self.interval("productive", start, at, "step-report", step_from=first, step_to=step)
        self.span_from = (at, step)
        self.mark_at = max(self.mark_at, at)

    def trainer_exited(self, *, at: float | None = None, basis: str = "exec-start") -> None:
        """The trainer is gone (at ``at``, else now): its training closed at its last
        step, or its start-up (``basis``) at its end if it reported none; how the attempt
        ended is ``exit_was``'s to say."""
        now = self.clock.time() if at is None else at
        if self.span_from is not None:
            self._close_span(*self.samples[-1])
        elif self.trainer_started_at is not None:
            self.interval("startup", self.trainer_started_at, now, basis)
        self.exited_at = now
        self.trainer_started_at = None
        self.ended = (list(self.samples), now, self.attempt)

    def exit_was(self, cause: str, *, interrupted: bool, basis: str = "trainer-exit") -> None:
        """How the attempt that exited ended: interrupted (a crash, a notice: the rest
        after its last step is down), or done (a normal exit: the run's work ended with
        its last step, or the save it reported after it; what follows, the trainer's own
        way out, is no part of the run: ``finished`` is marked there, ``done_at``)."""
        if self.ended is None:
            return
        samples, ended_at, attempt = self.ended
        self.mark_at = max(self.mark_at, ended_at)
        if not interrupted:
            last = samples[-1][0] if samples else ended_at
            self.done_at = max(last, self.saved_at) if self.saved_at <= ended_at else last
            return
        if samples and samples[-1][0] < ended_at:
            self._append(
                Interval(self._id(), self.host, attempt, "down", samples[-1][0], ended_at, basis)
            )
        last_step = samples[-1][1] if samples else None
        self._append(
            Mark(self._id(), self.host, attempt, "interrupted", ended_at, cause, last_step)
        )

    def trainer_ended(self, cause: str, *, interrupted: bool) -> None:
        """``ckptd exec``: its child exited (``cause`` as ``restarts.cause_of`` says)."""
        self.poll()
        self.trainer_exited()
        self.exit_was(cause, interrupted=interrupted)

    def noticed(self, at: float, source: str) -> None:
        self.mark("notice", at, source)
        self.notice_cause = notice_cause(source)

    def flushed(self, at: float | None = None) -> None:
        """The notice's flush ended: waiting for the commit since the trainer stopped."""
        now = self.clock.time() if at is None else at
        self.interval("wait_commit", self.mark_at, now, "exec-flush")
        self.mark_at = max(self.mark_at, now)

    def finished(self) -> None:
        """The trainer finished the run: it ends where its work did (``exit_was``)."""
        at = self.done_at if self.done_at is not None else self.exited_at
        self.mark("finished", at if at is not None else self.clock.time())

    def stopped(self, detail: str) -> None:
        """This writer stops recording (its process exits): readers stop counting the run
        as live (``model.recording``)."""
        self.mark("stopped", max(self.mark_at, self.clock.time()), detail)

    # -- what it adds up to ----------------------------------------------------------------

    def records(self) -> list[Record]:
        """The store's ledger as read at start-up and everything journaled here."""
        return merge_records(self.stored, self.journal.records())

    def summary(self, *, since: float | None = None) -> Goodput:
        """The run as this writer knows it, until now: it is recording it. Asked every
        second (``/v1/status``, the metrics): made again when a record was added, else at
        most every ``SUMMARY_SECONDS`` (only its trailing time to now is older)."""
        now = self.clock.time()
        key = (since is None, len(self.stored), self.journal.appended)
        cached = self.summaries.get(key[0])
        if cached is not None and cached[0] == key and now - cached[1] < SUMMARY_SECONDS:
            return cached[2]
        made = goodput(self.records(), until=now, since=since)
        self.summaries[key[0]] = (key, now, made)
        return made
