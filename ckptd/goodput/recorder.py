"""``ckptd exec``'s goodput recorder: turns what exec sees (its start, the restore, each
trainer start and end, the trainer's step and save reports, a notice and its flush) into
ledger records (``ckptd.goodput.model``), journals them locally and ships them to the store.

Invariants:
- A record is appended (one line, fsync'd) to ``<state dir>/goodput/<run>.jsonl`` before it
  counts anywhere; ``<run>.shipped`` holds how many of those lines the store has. Shipping
  writes the unshipped lines as one new object (``Repository.write_ledger_chunk``)
  and only then advances ``.shipped``. A kill -9 between the two ships the same records
  again under another key: their ids are unchanged, so readers count them once. A kill -9
  before a record is journaled loses at most the open productive span (closed every
  ``SPAN_SECONDS``): the next life on this node takes it from the step report the trainer
  left in the watch dir; on another node it reads as down (``ledger-gap``), never as
  productive.
- The store is best effort: a write it refuses is retried at the next ship, never fatal.
- Time is the wall clock (``Clock.time``), as the trainer's reports are.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

from ckptd.core import handoff, saves
from ckptd.goodput.model import (
    Goodput,
    Interval,
    Mark,
    Record,
    chunk_bytes,
    goodput,
    lost_span,
    merge_records,
    parse_chunk,
    parse_record,
    span,
)
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.logs import get_logger
from ckptd.storage.base import StorageError
from ckptd.store.repository import Repository

# A productive span is closed (journaled) at least this often.
SPAN_SECONDS = 10.0
STEPS_RELPATH = handoff.STEPS


def read_ledger(repo: Repository, run_id: str) -> list[Record]:
    """Every record of the run's ledger in the store (StorageError when unreadable)."""
    return merge_records(*(parse_chunk(c) for c in repo.read_ledger_chunks(run_id)))


def read_step_report(watch_dir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((watch_dir / STEPS_RELPATH).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(doc, dict) and isinstance(doc.get("step"), int)
    return doc if ok and isinstance(doc.get("at"), int | float) else None


class GoodputRecorder:
    """One ``ckptd exec``'s part of the run ledger (module doc)."""

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
        self.dir = state_dir / "goodput"
        self.journal = self.dir / f"{run_id}.jsonl"
        self.shipped_path = self.dir / f"{run_id}.shipped"
        self.seq = 0
        self.stored: list[Record] = []  # the store's ledger as read at start-up
        self.attempt = self.writer
        self.starts = 0
        self.began = clock.time()
        self.mark_at = self.began  # the end of what is recorded on this node so far
        self.trainer_started_at: float | None = None
        self.first_step_at: float | None = None
        self.samples: list[tuple[float, int]] = []  # this attempt's (time, step)
        self.span_from: tuple[float, int] | None = None
        self.saves_seen = 0.0  # the newest save report taken (its ``at``)
        self.ship_lock = asyncio.Lock()
        self.journaled: list[Record] | None = None  # the journal's records, read once

    # -- the journal -----------------------------------------------------------------------

    def _id(self) -> str:
        self.seq += 1
        return f"{self.writer}:{self.seq}"

    def _append(self, record: Record) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.journal.open("a") as f:
            f.write(json.dumps(record.to_json(), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.journaled is not None:
            self.journaled.append(record)

    def interval(self, cause: str, start: float, end: float, basis: str, **kw: Any) -> None:
        if end > start:
            self._append(
                Interval(self._id(), self.host, self.attempt, cause, start, end, basis, **kw)
            )

    def mark(self, kind: str, at: float, detail: str = "", step: int | None = None) -> None:
        self._append(Mark(self._id(), self.host, self.attempt, kind, at, detail, step))

    def journal_lines(self) -> list[str]:
        try:
            return self.journal.read_text().splitlines()
        except OSError:
            return []

    def local_records(self) -> list[Record]:
        """The journal's records (read from disk once, then kept as appended)."""
        if self.journaled is None:
            self.journaled = self._read_journal()
        return list(self.journaled)

    def _read_journal(self) -> list[Record]:
        out = []
        for line in self.journal_lines():
            try:
                record = parse_record(json.loads(line))
            except ValueError:
                continue  # a torn last line (killed mid-write)
            if record is not None:
                out.append(record)
        return out

    def _shipped(self) -> int:
        try:
            return int(self.shipped_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    async def ship(self) -> None:
        """Write the unshipped journal lines to the store (module doc)."""
        async with self.ship_lock:
            lines = self.journal_lines()
            done = self._shipped()
            records = []
            for line in lines[done:]:
                try:
                    record = parse_record(json.loads(line))
                except ValueError:
                    continue
                if record is not None:
                    records.append(record)
            if not records:
                return
            body = chunk_bytes(self.run_id, self.writer, records)
            try:
                await asyncio.to_thread(
                    self.repo.write_ledger_chunk, self.run_id, self.writer, done, body
                )
            except StorageError as exc:
                self.log.warning("goodput_ship_failed", error=str(exc))
                return
            tmp = self.shipped_path.with_suffix(".tmp")
            tmp.write_text(str(len(lines)))
            os.replace(tmp, self.shipped_path)

    # -- what exec sees --------------------------------------------------------------------

    async def load(self) -> None:
        """Ship what an earlier life of this node left unshipped, read the store's ledger,
        and record the down time since the run's last record there (a fresh node or a
        restarted exec: from the interruption to this start)."""
        now = self.clock.time()
        await self.ship()
        try:
            self.stored = await asyncio.to_thread(read_ledger, self.repo, self.run_id)
        except StorageError as exc:
            self.log.warning("goodput_ledger_unreadable", error=str(exc))
        self.mark_at = now
        bounds = span(self.stored)
        finished = any(isinstance(r, Mark) and r.kind == "finished" for r in self.stored)
        if bounds is not None and bounds[1] < now and not finished:
            self.interval("down", bounds[1], now, "ledger-gap")
        previous = self._previous()
        if previous is not None and not finished:
            node, attempt, ended = previous
            ends = {"interrupted", "finished"}
            if not any(
                isinstance(r, Mark) and r.kind in ends and r.attempt == attempt for r in self.stored
            ):
                # Its exec died with it (kill -9, the node lost): no one marked the end.
                # On this node its trainer's last step report is still in the watch dir.
                ended = self._left_behind(node, attempt, ended)
                self._append(
                    Mark(self._id(), node, attempt, "interrupted", ended, "exec-gone", None)
                )

    def restored(self, start: float, end: float) -> None:
        """The restore before the first start."""
        self.interval("startup", self.mark_at, start, "exec-start")
        self.interval("restore", start, end, "exec-restore")
        self.mark_at = max(self.mark_at, end)

    def _left_behind(self, node: str, attempt: str, ended: float) -> float:
        """The training a dead exec's trainer did after its last journaled span, from its
        step report left in this node's watch dir (node = this host); the attempt's end."""
        doc = read_step_report(self.watch_dir)
        if node != self.host or doc is None or float(doc["at"]) <= ended:
            return ended
        at, step = float(doc["at"]), int(doc["step"])
        spans = [
            r
            for r in self.stored
            if isinstance(r, Interval) and r.attempt == attempt and r.cause == "productive"
        ]
        if spans and spans[-1].step_to is not None:
            start, first = spans[-1].end, spans[-1].step_to
        elif isinstance(doc.get("first_at"), int | float) and isinstance(
            doc.get("first_step"), int
        ):
            start, first = float(doc["first_at"]), int(doc["first_step"])
        else:
            return ended
        if start >= at or first > step:
            return ended
        self._append(
            Interval(
                self._id(), node, attempt, "productive", start, at, "step-report-left", first, step
            )
        )
        return at

    def _previous(self) -> tuple[str, str, float] | None:
        """The node, attempt and end of the run's last attempt before this exec (this
        node's rank's, with many nodes), from the store's ledger."""
        intervals = [r for r in self.stored if isinstance(r, Interval)]
        if "#" in self.host:
            rank = self.host.rsplit("#", 1)[1]
            intervals = [r for r in intervals if r.node.endswith(f"#{rank}")] or intervals
        if not intervals:
            return None
        last = max(intervals, key=lambda r: r.end)
        ended = max(r.end for r in intervals if r.attempt == last.attempt)
        return last.node, last.attempt, ended

    def _lost_before(self, step: int) -> None:
        """Progress the previous attempt (the store's ledger) made past ``step``, where
        this exec's first trainer resumes, is lost."""
        previous = self._previous()
        if previous is None:
            return
        node, attempt, ended = previous
        records = self.records()  # the store's, and what load() added from this node
        ended = max(
            [ended, *(r.end for r in records if isinstance(r, Interval) and r.attempt == attempt)]
        )
        samples = sorted(
            sample
            for r in records
            if isinstance(r, Interval)
            and r.cause == "productive"
            and r.attempt == attempt
            and r.step_from is not None
            and r.step_to is not None
            for sample in ((r.start, r.step_from), (r.end, r.step_to))
        )
        self._lost(samples, step, ended, node, attempt)

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

    def trainer_started(self, step: int | None) -> None:
        now = self.clock.time()
        if self.starts == 0:
            self._lost_before(step or 0)  # no checkpoint: it starts again from scratch
        self.starts += 1
        self.attempt = f"{self.writer}/{self.starts}"
        self.interval("startup", self.mark_at, now, "exec-start")
        self.trainer_started_at = self.mark_at = now
        self.first_step_at = None
        self.samples, self.span_from = [], None

    def poll(self) -> None:
        """Take the trainer's newest step and save reports; close the productive span when
        it is ``SPAN_SECONDS`` old."""
        if self.trainer_started_at is None:
            return
        doc = read_step_report(self.watch_dir)
        if doc is not None and float(doc["at"]) >= self.trainer_started_at:
            at, step = float(doc["at"]), int(doc["step"])
            if self.first_step_at is None:
                first_at, first_step = doc.get("first_at"), doc.get("first_step")
                if not isinstance(first_at, int | float) or not isinstance(first_step, int):
                    first_at, first_step = at, step  # an older helper: its first report seen
                self.first_step_at = float(first_at)
                self.interval("startup", self.trainer_started_at, self.first_step_at, "step-report")
                self.span_from = (self.first_step_at, first_step)
                self.samples.append(self.span_from)
            if not self.samples or self.samples[-1] != (at, step):
                self.samples.append((at, step))
        for report in saves.read_reports(self.watch_dir):
            when, seconds = report.get("at"), report.get("save_seconds")
            if not isinstance(when, int | float) or when <= self.saves_seen:
                continue
            self.saves_seen = float(when)
            if isinstance(seconds, int | float) and when >= self.trainer_started_at:
                self.interval("save", float(when) - seconds, float(when), "trainer")
        if (
            self.span_from is not None
            and self.samples
            and self.samples[-1][0] - self.span_from[0] >= SPAN_SECONDS
        ):
            self._close_span(*self.samples[-1])

    def _close_span(self, at: float, step: int) -> None:
        assert self.span_from is not None
        start, first = self.span_from
        self.interval("productive", start, at, "step-report", step_from=first, step_to=step)
        self.span_from = (at, step)
        self.mark_at = max(self.mark_at, at)

    def trainer_ended(self, cause: str, *, interrupted: bool) -> None:
        """The trainer exited (``cause`` as ``restarts.cause_of`` says)."""
        now = self.clock.time()
        self.poll()
        if self.span_from is not None:
            # Training ended with its last step; the rest is the trainer's way out (the
            # emergency save, shown as such; its exit), not training.
            self._close_span(*self.samples[-1])
            self.interval("down", self.samples[-1][0], now, "trainer-exit")
        elif self.trainer_started_at is not None:
            self.interval("startup", self.trainer_started_at, now, "exec-start")
        self.mark_at = now
        last = self.samples[-1][1] if self.samples else None
        if interrupted:
            self.mark("interrupted", now, cause, last)
        self.ended_samples, self.ended_at = list(self.samples), now
        self.trainer_started_at = None

    def restarting(self, resumed_step: int | None) -> None:
        """The next attempt starts from ``resumed_step``: what the last one did past it is
        lost; the wait until the start is down time."""
        if getattr(self, "ended_samples", None):
            # No checkpoint (None): it starts again from scratch.
            self._lost(
                self.ended_samples, resumed_step or 0, self.ended_at, self.host, self.attempt
            )
        now = self.clock.time()
        self.interval("down", self.mark_at, now, "exec-restart")
        self.mark_at = now

    def noticed(self, at: float, source: str) -> None:
        self.mark("notice", at, source)

    def flushed(self) -> None:
        """The notice's flush ended: waiting for the commit since the trainer stopped."""
        now = self.clock.time()
        self.interval("wait_commit", self.mark_at, now, "exec-flush")
        self.mark_at = now

    def finished(self) -> None:
        """The trainer finished the run: it ends when the trainer exited."""
        self.mark("finished", getattr(self, "ended_at", self.clock.time()))

    # -- what it adds up to ----------------------------------------------------------------

    def records(self) -> list[Record]:
        """The store's ledger as read at start-up and everything journaled here."""
        return merge_records(self.stored, self.local_records())

    def summary(self, *, since: float | None = None) -> Goodput:
        return goodput(self.records(), until=self.clock.time(), since=since)
