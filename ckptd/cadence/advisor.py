"""The cadence advisor: measures what saves cost and how often the run is interrupted,
keeps that history under the run in the store, and publishes the advised interval
(``GET /v1/advice``, ``ckptd_advised_checkpoint_interval_seconds``, and the file
``<watch dir>/.ckptd/advice.json`` that the trainer helpers read).

Measured here, per run:
- a save's blocking time: the trainer's own report when it wrote one
  (``<watch dir>/.ckptd/saves.jsonl``, one JSON line per save: ``checkpoint`` or ``step``,
  ``save_seconds``), else the time from its first file written to its last;
- its upload time: complete -> committed;
- interruptions: cloud notices and SIGTERM (drills are not interruptions), restarts of the
  trainer under ``ckptd exec``, restores onto a fresh node;
- the time observed: how long this daemon has watched the run.

The other runs under the same destination count too (``cadence.OtherRuns``,
``[cadence] learn_from_other_runs``): their ``<run>/CADENCE`` is read at start-up and
every ``OTHER_RUNS_REFRESH_SECONDS``, never written.

The store's ``<run>/CADENCE`` is the history a new node inherits. It is read at start-up,
beside the daemon's start and never holding it: until it is read, or when the store
cannot be read, the advice rests on what this node saw and the prior (``history`` in the
advice says which: ``reading``, ``read`` or ``unreadable``). It is rewritten
read-modify-write (``cadence.merge_history``) when there is something new, at most every
``FLUSH_SECONDS`` for the observed time alone. With many nodes only node 0
writes it (every node's notice of one reclaim is the same interruption, and the nodes'
observed times are one run's); every node reads it and advises. A write lost to a
concurrent writer loses records, never the daemon: the advice only drifts toward its prior.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.cadence.history import read_history, write_history
from ckptd.cadence.model import (
    NO_OTHER_RUNS,
    Advice,
    Bounds,
    CadencePolicy,
    History,
    Interruption,
    OtherRuns,
    SaveRecord,
    advise,
    merge_history,
    restore_interruption,
    while_volatile,
)
from ckptd.config import Settings
from ckptd.core import handoff, saves
from ckptd.layouts.base import step_of
from ckptd.repository import Repository
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.logs import get_logger
from ckptd.storage.base import StorageError

if TYPE_CHECKING:
    from ckptd.runtime.metrics import Metrics  # prometheus_client: the daemon's, not restore's

FLUSH_SECONDS = 60.0
# The other runs' histories (cadence.OtherRuns) are read at start-up and this often.
OTHER_RUNS_REFRESH_SECONDS = 3600.0
# At most this many other runs are read (one GET each).
OTHER_RUNS_MAX = 200
ADVICE_RELPATH = handoff.ADVICE
SAVES_RELPATH = handoff.SAVES


def policy_of(settings: Settings) -> CadencePolicy:
    c = settings.cadence
    return CadencePolicy(
        mtbf_override=c.mtbf_hours * 3600.0 if c.mtbf_hours > 0 else None,
        prior_mtbf=c.prior_mtbf_hours * 3600.0,
        bounds=Bounds(c.min_interval_seconds, c.max_interval_seconds),
        merge_seconds=c.merge_seconds,
    )


def reported_save_seconds(watch_dir: Path, checkpoint: str) -> float | None:
    """The trainer's own save time for ``checkpoint`` from ``saves.jsonl`` (matched by
    name, else by step), or None."""
    return saves.save_seconds(saves.read_reports(watch_dir), checkpoint, step_of(checkpoint))


def write_advice_file(watch_dir: Path, body: dict[str, Any]) -> None:
    """``<watch dir>/.ckptd/advice.json``, replaced atomically (tmp + rename)."""
    target = watch_dir / ADVICE_RELPATH
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".advice.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, sort_keys=True))
    os.replace(tmp, target)


@dataclass
class RunCadence:
    """One run's history as last read or written, and what is not in the store yet."""

    run_id: str
    watch_dir: Path
    history: History
    saves: list[SaveRecord] = field(default_factory=list)
    interruptions: list[Interruption] = field(default_factory=list)
    observed: float = 0.0  # seconds watched since the last write
    advice: Advice | None = None
    published: dict[str, Any] | None = None
    history_state: str = "reading"  # the store's history: reading | read | unreadable
    volatile: bool = False  # the trainer's loss spiked and is not back (ckptd.health.loss)

    @property
    def unsaved(self) -> bool:
        return bool(self.saves or self.interruptions)

    def view(self) -> History:
        """The history with what is not yet in the store."""
        return merge_history(
            self.history,
            saves=self.saves,
            interruptions=self.interruptions,
            observed_seconds=self.observed,
        )


class CadenceAdvisor:
    """Keeps each run's cadence history and advice (module doc)."""

    def __init__(
        self,
        settings: Settings,
        repo: Repository,
        metrics: Metrics,
        watch_dirs: dict[str, Path],
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.policy = policy_of(settings)
        self.repo = repo
        self.metrics = metrics
        self.clock = clock
        self.log = get_logger()
        self.writer = settings.cluster.rank == 0
        self.host = socket.gethostname()
        self.runs = {r: RunCadence(r, d, History(r)) for r, d in watch_dirs.items()}
        self.learn_from_others = settings.cadence.learn_from_other_runs
        self.others: OtherRuns = NO_OTHER_RUNS
        self._others_read_at: float | None = None
        self._last_tick = clock.monotonic()
        self._last_flush = self._last_tick
        self._lock = asyncio.Lock()

    # -- records -------------------------------------------------------------------------

    def record_save(
        self,
        run: str,
        checkpoint: str,
        completed_at: float,
        write_span: float,
        upload_seconds: float,
        emergency: bool,
    ) -> None:
        """A committed checkpoint's costs (the pipeline's ``on_cost``)."""
        state = self.runs.get(run)
        if state is None:
            return
        reported = reported_save_seconds(state.watch_dir, checkpoint)
        state.saves.append(
            SaveRecord(
                checkpoint,
                completed_at,
                write_span if reported is None else reported,
                upload_seconds,
                "files" if reported is None else "trainer",
                emergency,
            )
        )
        self.refresh(run)

    def record_interruption(self, kind: str, source: str = "", run: str | None = None) -> None:
        """An interruption of ``run`` (every run on this node when None)."""
        self._add_interruption(Interruption(self.clock.time(), kind, source, self.host), run)

    def record_restore(self, run: str, checkpoint: str, *, skipped: bool) -> None:
        """A restore of ``run`` onto this node (``ckptd exec``: into its watch dir, so a
        resume); counted as ``restore_interruption`` says."""
        record = restore_interruption(
            checkpoint, skipped=skipped, resumes=True, at=self.clock.time(), node=self.host
        )
        if record is not None:
            self._add_interruption(record, run)

    def _add_interruption(self, record: Interruption, run: str | None) -> None:
        for name, state in self.runs.items():
            if run is None or name == run:
                state.interruptions.append(record)
                self.refresh(name)
        self.log.info("cadence_interruption", kind=record.kind, source=record.source, run=run)

    # -- advice --------------------------------------------------------------------------

    def set_volatile(self, run: str, volatile: bool) -> None:
        """The run's loss turned volatile (a spike, a non-finite loss) or came back: the
        advice shortens meanwhile (``cadence.model.while_volatile``); published at the
        next flush."""
        state = self.runs.get(run)
        if state is not None and state.volatile != volatile:
            state.volatile = volatile
            self.refresh(run)

    def refresh(self, run: str) -> Advice:
        state = self.runs[run]
        advice = advise(state.view(), self.policy, self.others)
        state.advice = while_volatile(advice, self.policy.bounds) if state.volatile else advice
        self.metrics.advised_interval.labels(run=run).set(state.advice.interval_seconds)
        return state.advice

    def advice_json(self) -> dict[str, Any]:
        """What ``GET /v1/advice`` answers."""
        return {
            "runs": {
                run: (state.advice or self.refresh(run)).to_json()
                | {"history": state.history_state}
                for run, state in self.runs.items()
            }
        }

    async def _publish(self, state: RunCadence) -> None:
        advice = state.advice or self.refresh(state.run_id)
        body = {
            "run": state.run_id,
            "interval_seconds": round(advice.interval_seconds, 3),
            "restart_interval_seconds": round(advice.restart_interval_seconds, 3),
            "save_seconds": round(advice.save_seconds, 3),
            "mtbf_seconds": round(advice.mtbf_seconds, 3),
            "basis": advice.basis,
        }
        if body == state.published or not state.watch_dir.is_dir():
            return
        try:
            await asyncio.to_thread(write_advice_file, state.watch_dir, body)
            state.published = body
        except OSError as exc:
            self.log.warning("advice_file_failed", dir=str(state.watch_dir), error=str(exc))

    # -- the store -----------------------------------------------------------------------

    async def load(self) -> None:
        """Read every run's history from the store (start-up); a failure leaves it empty."""
        await self._read_others()
        for run, state in self.runs.items():
            try:
                state.history = await asyncio.to_thread(read_history, self.repo, run)
                state.history_state = "read"
            except StorageError as exc:
                state.history_state = "unreadable"
                self.log.warning("cadence_history_unreadable", run=run, error=str(exc))
            self.refresh(run)
            await self._publish(state)

    async def flush(self, *, force: bool = False) -> None:
        """Write what is new to each run's ``<run>/CADENCE`` (node 0 only)."""
        async with self._lock:
            now = self.clock.monotonic()
            for state in self.runs.values():
                state.observed += max(0.0, now - self._last_tick)
            self._last_tick = now
            due = force or now - self._last_flush >= FLUSH_SECONDS
            if (
                self._others_read_at is not None
                and now - self._others_read_at >= OTHER_RUNS_REFRESH_SECONDS
            ):
                await self._read_others()
            for run, state in self.runs.items():
                if self.writer and (state.unsaved or (due and state.observed > 0)):
                    await self._write(state)
                self.refresh(run)
                await self._publish(state)
            if due:
                self._last_flush = now

    async def _read_others(self) -> None:
        """The histories of the store's other runs (``cadence.OtherRuns``); on a failure
        the ones read before stand."""
        if not self.learn_from_others:
            return
        self._others_read_at = self.clock.monotonic()
        mine = set(self.runs)

        def read() -> list[History]:
            names = [r for r in self.repo.list_runs() if r not in mine][:OTHER_RUNS_MAX]
            return [read_history(self.repo, r) for r in names]

        try:
            histories = await asyncio.to_thread(read)
        except StorageError as exc:
            self.log.warning("cadence_other_runs_unreadable", error=str(exc))
            return
        self.others = OtherRuns.of(histories, self.policy.merge_seconds)
        if self.others.observed_seconds > 0:
            self.log.info(
                "cadence_other_runs",
                runs=sum(1 for h in histories if h.observed_seconds > 0),
                observed_hours=round(self.others.observed_seconds / 3600, 1),
                interruptions=self.others.runs_interrupted + len(self.others.gaps),
            )

    async def _write(self, state: RunCadence) -> None:
        saves, interruptions, observed = (
            list(state.saves),
            list(state.interruptions),
            state.observed,
        )

        def read_merge_write() -> History:
            merged = merge_history(
                read_history(self.repo, state.run_id),
                saves=saves,
                interruptions=interruptions,
                observed_seconds=observed,
            )
            write_history(self.repo, merged)
            return merged

        try:
            state.history = await asyncio.to_thread(read_merge_write)
            state.history_state = "read"
        except StorageError as exc:
            self.log.warning("cadence_history_write_failed", run=state.run_id, error=str(exc))
            return
        del state.saves[: len(saves)]
        del state.interruptions[: len(interruptions)]
        state.observed -= observed


def record_restore(
    repo: Repository,
    run_id: str,
    checkpoint: str,
    *,
    skipped: bool,
    resumes: bool,
    now: float,
) -> None:
    """Add a restore of ``run_id`` onto this node to the run's history in the store, when
    ``restore_interruption`` counts it (``ckptd restore``, best effort: a store that
    refuses the write costs the record, not the restore)."""
    record = restore_interruption(
        checkpoint, skipped=skipped, resumes=resumes, at=now, node=socket.gethostname()
    )
    if record is None:
        return
    with contextlib.suppress(StorageError):
        merged = merge_history(read_history(repo, run_id), interruptions=[record])
        write_history(repo, merged)


__all__ = [
    "ADVICE_RELPATH",
    "SAVES_RELPATH",
    "CadenceAdvisor",
    "policy_of",
    "record_restore",
    "reported_save_seconds",
    "write_advice_file",
]
