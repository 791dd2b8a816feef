"""Drills on the running daemon: one at a time, each recorded once beside its run in the
store, counted, and remembered for ``/v1/status``.

A drill here (``ckptd.drill.model``) is the responder's simulated notice (signalled ->
complete -> committed before the deadline), then, when that held, the proof on the
checkpoint it committed (``ckptd.drill.proof``: restored -> verified -> loaded, in a
thread). It belongs to the run whose emergency checkpoint it committed (the first run
watched here when none was). Its record is written whether it passed or not; a record
the store refuses is logged (``drill_record_not_written``), and the answer, the log and
the metrics still say what the drill found.

Each run's last ``[drill] history`` records are listed in the store at start-up and every
``HISTORY_REFRESH_SECONDS`` (a restore-only drill run from another node shows up so; only
records not read before are fetched), and the gauges are set from them: the last success
and failure, the success ratio over every kind of drill, that of the drills that resumed
the trainer and the last of them that passed, and each stage of the last drill. So a
restarted daemon, and every node of a run, says the same of the run's drills, and the
alerts on them outlive a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from ckptd.config import Settings
from ckptd.core.errors import CkptdError
from ckptd.drill.model import (
    FAILURE,
    RESTORE_STAGES,
    STAGES,
    SUCCESS,
    DrillRecord,
    StageResult,
    drill_id,
    not_reached,
    parse_record,
    summarize,
)
from ckptd.drill.proof import ProofRequest, clear_stale, prove
from ckptd.repository import Repository, drill_prefix
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import NotFoundError, Storage, StorageError

HISTORY_REFRESH_SECONDS = 60.0
# What the responder's drill does: a simulated notice, answered with its timings.
NoticeDrill = Callable[[float], Awaitable[dict[str, Any]]]


class DrillBusyError(CkptdError):
    """A drill was asked for while one runs (``POST /v1/drill`` answers 409)."""


def notice_stages(timings: dict[str, Any], signal_name: str) -> list[StageResult]:
    """The first three stages from the responder's drill timings (``Response.timings``):
    each stage's own seconds, and the first that did not hold failed."""
    signalled = timings.get("signalled_after_s")
    complete = timings.get("complete_after_s")
    committed = timings.get("committed_after_s")
    in_time = bool(timings.get("committed_before_deadline"))
    pids, spared = timings.get("trainer_pids") or [], timings.get("skipped_pids") or []
    out: list[StageResult] = []
    if signalled is not None:
        out.append(StageResult("signalled", "ok", signalled, f"pids {pids}"))
    elif complete is not None:
        out.append(
            StageResult("signalled", "skipped", None, "no process signalled; the trainer saved")
        )
    else:
        why = (
            f"no matched process handles {signal_name} (spared pids {spared})"
            if spared
            else "no trainer found (trainer.pidfile / trainer.match)"
        )
        out.append(StageResult("signalled", "failed", None, f"no process signalled: {why}"))
        return [*out, *not_reached(STAGES[1:3])]
    if complete is None:
        out.append(
            StageResult(
                "complete", "failed", None, "no checkpoint was complete before the deadline"
            )
        )
        return [*out, *not_reached(STAGES[2:3])]
    name = timings.get("checkpoint") or ""
    out.append(StageResult("complete", "ok", complete - (signalled or 0.0), name))
    if committed is None or not in_time:
        when = "" if committed is None else f" (committed {committed:.3f} s after the notice)"
        out.append(
            StageResult(
                "committed", "failed", None, f"{name} not committed before the deadline{when}"
            )
        )
    else:
        out.append(
            StageResult("committed", "ok", committed - complete, f"{timings.get('bytes', 0)} bytes")
        )
    return out


class DrillRunner:
    """Runs this daemon's drills and keeps each run's drill history (module doc)."""

    def __init__(
        self,
        settings: Settings,
        notice_drill: NoticeDrill,
        storage: Storage,
        metrics: Metrics,
        *,
        runs: list[str],
        host: str,
        clock: Clock,
        log: Any,
    ) -> None:
        self.settings = settings
        self.config = settings.drill
        self.notice_drill = notice_drill
        self.storage = storage
        self.repo = Repository(storage)
        self.metrics = metrics
        self.runs = list(runs)
        self.host = host
        self.clock = clock
        self.log = log
        self.scratch_root = self.config.scratch(settings.state.dir)
        self.history: dict[str, dict[str, DrillRecord]] = {run: {} for run in self.runs}
        self._lock = asyncio.Lock()
        for run in self.runs:
            for result in (SUCCESS, FAILURE):
                metrics.drills.labels(run=run, result=result)

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    # -- one drill --------------------------------------------------------------------------

    async def drill(
        self, deadline: float, *, trigger: str = "command", period: float | None = None
    ) -> dict[str, Any]:
        """A whole drill (module doc); its timings as ``POST /v1/drill`` answers them."""
        if self._lock.locked():
            raise DrillBusyError("a drill is already running on this node; try again after it")
        async with self._lock:
            started = self.clock.time()
            timings = await self.notice_drill(deadline)
            run = timings.get("run") or (self.runs[0] if self.runs else "")
            identity = drill_id(started, self.host)
            stages = notice_stages(timings, self.settings.trainer.signal)
            checkpoint, size = timings.get("checkpoint"), int(timings.get("bytes") or 0)
            error = next((s.detail for s in stages if s.status == "failed"), "")
            if error:
                stages += not_reached(RESTORE_STAGES)
            else:
                proof = await self._prove(run, checkpoint, identity)
                stages += proof.stages
                error = proof.error
            record = DrillRecord(
                run_id=run,
                drill_id=identity,
                kind="full",
                trigger=trigger,
                node=self.host,
                started=started,
                finished=self.clock.time(),
                stages=tuple(stages),
                checkpoint=checkpoint,
                total_bytes=size,
                error=error,
                period=period,
                deadline_seconds=deadline,
            )
            key = await self._finish(record)
            return {
                **timings,
                "id": record.drill_id,
                "result": record.result,
                "failed_stage": record.failed_stage,
                "error": record.error,
                "stages": record.timings(),
                "record": key,
            }

    async def _prove(self, run: str, checkpoint: str | None, identity: str) -> Any:
        await asyncio.to_thread(clear_stale, self.scratch_root)
        request = ProofRequest(
            run,
            checkpoint,
            self.scratch_root / identity,
            self.config.check,
            self.config.check_timeout_seconds,
            concurrency=self.settings.destination.concurrency,
            keys=self.settings.authentication.key_ring(),
        )
        return await asyncio.to_thread(prove, self.storage, request, monotonic=self.clock.monotonic)

    async def _finish(self, record: DrillRecord) -> str | None:
        """Record ``record`` in the store, count it, log it; its key (None: not written)."""
        key: str | None = None
        try:
            key = await asyncio.to_thread(
                self.repo.write_drill_record, record.run_id, record.drill_id, record.to_bytes()
            )
        except StorageError as exc:
            self.log.error("drill_record_not_written", run=record.run_id, error=str(exc))
        self.metrics.drills.labels(run=record.run_id, result=record.result).inc()
        # Remembered as the store holds it (times to the millisecond), as every node reads it.
        stored = parse_record(record.to_bytes()) or record
        self.history.setdefault(record.run_id, {})[record.drill_id] = stored
        self.export(record.run_id)
        fields = {
            "run": record.run_id,
            "checkpoint": record.checkpoint,
            "trigger": record.trigger,
            "stages": {s["stage"]: s["seconds"] for s in record.timings()},
            "record": key,
        }
        if record.failed_stage is None:
            self.log.info("drill_passed", **fields)
        else:
            self.log.error(
                "drill_failed", failed_stage=record.failed_stage, error=record.error, **fields
            )
        return key

    # -- the history ------------------------------------------------------------------------

    def _read_new(self, run: str) -> list[bytes]:
        """The run's last ``[drill] history`` records not already known here (a listing,
        then one read per new record)."""
        prefix, known = drill_prefix(run), self.history.get(run, {})
        keys = sorted(o.key for o in self.storage.list_objects(prefix))
        bodies = []
        for key in keys[-self.config.history :]:
            if key[len(prefix) :].removesuffix(".json") in known:
                continue
            try:
                bodies.append(self.storage.get_bytes(key))
            except NotFoundError:
                continue  # removed while we listed
        return bodies

    async def refresh(self) -> None:
        """Read each run's last drills from the store, and set the gauges from them."""
        for run in self.runs:
            try:
                bodies = await asyncio.to_thread(self._read_new, run)
            except StorageError as exc:
                self.log.warning("drill_history_unreadable", run=run, error=str(exc))
                continue
            known = self.history.setdefault(run, {})
            for record in (parse_record(b) for b in bodies):
                if record is not None and record.run_id == run:
                    known.setdefault(record.drill_id, record)
            newest = sorted(known.values(), key=lambda r: (r.started, r.drill_id))
            self.history[run] = {r.drill_id: r for r in newest[-self.config.history :]}
            self.export(run)

    async def keep_history(self) -> None:
        """``refresh`` now and every ``HISTORY_REFRESH_SECONDS`` (the main loop's task)."""
        while True:
            with contextlib.suppress(Exception):  # the store's trouble is logged in refresh
                await self.refresh()
            await asyncio.sleep(HISTORY_REFRESH_SECONDS)

    def export(self, run: str) -> None:
        """The run's gauges from its history; none until the run has a drill."""
        summary = summarize(list(self.history.get(run, {}).values()), self.config.history)
        if summary.last is None:
            return
        m = self.metrics
        m.drill_last_success.labels(run=run).set(summary.last_success or 0)
        m.drill_last_failure.labels(run=run).set(summary.last_failure or 0)
        m.drill_success_ratio.labels(run=run).set(summary.rate or 0.0)
        if summary.resume_rate is not None:
            m.drill_resume_success_ratio.labels(run=run).set(summary.resume_rate)
            m.drill_last_resume_success.labels(run=run).set(summary.last_resume_success or 0)
        else:  # none among the last drills: no series, no alert
            for gauge in (m.drill_resume_success_ratio, m.drill_last_resume_success):
                with contextlib.suppress(KeyError):
                    gauge.remove(run)
        for stage in summary.last.stages:
            if stage.seconds is None:
                with contextlib.suppress(KeyError):
                    m.drill_stage_seconds.remove(run, stage.stage)
            else:
                m.drill_stage_seconds.labels(run=run, stage=stage.stage).set(stage.seconds)

    def status(self) -> dict[str, Any]:
        """Each run's last drills for ``/v1/status`` (``DrillSummary.to_json``)."""
        return {
            run: summarize(list(records.values()), self.config.history).to_json()
            for run, records in self.history.items()
        }


__all__ = ["HISTORY_REFRESH_SECONDS", "DrillBusyError", "DrillRunner", "notice_stages"]
