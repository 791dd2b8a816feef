"""``ckptd exec``: the daemon with the trainer as its supervised child.

    build      the daemon's own (``ckptd.daemon.build``), then the trainer's supervisor
    start-up   the daemon's own (SIGTERM, and here SIGINT too, are notices from now on)
    restore    the run's newest committed checkpoint (in any tier) into the watch dir,
               unless a complete local one on the live line is as new (a rerun on the
               same node restores nothing), or this node's trainer reported a rollback
               that LATEST does not follow yet (its line lives here); its steps:
               ``ckptd.supervision.exec_restore``
    run        the trainer (``ckptd.supervision.supervisor``), the daemon's main loop beside it
    end        - the trainer finished by itself, or was given up on: ship what is
                 complete, exit with its code (``EXIT_GAVE_UP`` when given up on)
               - a notice (SIGTERM, SIGINT, a cloud's): nothing is started again; the
                 trainer is signalled (by the responder), its emergency checkpoint
                 waited for and committed, then the trainer stopped, and any newer
                 save of it committed too (``ckptd.supervision.exec_flush``); exit 0
                 when that checkpoint is committed, ``EXIT_FLUSH_FAILED`` when it is not
               - a second SIGTERM/SIGINT: stop now (``EXIT_FLUSH_FAILED``)
               A drill is none of these, nor a health save (``[health] save``), this
               node's or one followed from another node: the trainer saves and trains
               on, or, if it exited 0 for it, is started again from its checkpoint once
               the notice is over.
The trainer is never left running: whatever ends the daemon stops it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptd.config import Settings
from ckptd.config.control import read_token
from ckptd.core.errors import EXIT_FLUSH_FAILED
from ckptd.core.manifest import Manifest, ManifestError, epoch_of_timestamp
from ckptd.daemon.service import Service
from ckptd.goodput.model import DAY_SECONDS
from ckptd.goodput.recorder import GoodputRecorder
from ckptd.layouts.base import CheckpointListing
from ckptd.notices import carried
from ckptd.notices.model import Notice, NoticeSource
from ckptd.notices.sigterm import SigtermSource
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.storage import StorageError
from ckptd.store.tiers import TierStore, tier_configs
from ckptd.supervision import leftover
from ckptd.supervision.exec_flush import await_emergency, await_newer_saves
from ckptd.supervision.exec_restore import ExecError as ExecError  # re-exported
from ckptd.supervision.exec_restore import (
    newest_committed,
    restore_into,
    restore_needed,
    restored_status,
)
from ckptd.supervision.restarts import RestartPolicy, cause_of
from ckptd.supervision.supervisor import TrainerSupervisor
from ckptd.sync.resume import find_resume_point
from ckptd.sync.runs import RunState

# After its emergency checkpoint is committed, the trainer gets this long to exit by
# itself (it usually has already) before SIGTERM, then as long again before SIGKILL.
TRAINER_STOP_GRACE_SECONDS = 10.0
# The goodput recorder reads the trainer's reports this often, and ships this often.
GOODPUT_POLL_SECONDS = 0.25
GOODPUT_SHIP_SECONDS = 15.0
# A trainer that exits 0 this long after a drill's notice ended stopped for the drill.
DRILL_EXIT_SECONDS = 60.0
# A newer checkpoint complete but for its quiet window (the trainer that wrote it is
# gone) is waited for this long at most before the trainer starts again.
RESUME_SETTLE_MAX_SECONDS = 15.0


class SupervisedService(Service):
    """One daemon supervising one trainer: ``await SupervisedService(...).serve()``."""

    OBSERVES_TRAINER = False  # it knows its child: its own recorder keeps the ledger

    def __init__(
        self,
        settings: Settings,
        command: Sequence[str],
        *,
        policy: RestartPolicy,
        shutdown_timeout: float = 60.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(settings, shutdown_timeout=shutdown_timeout, clock=clock)
        watch = settings.watch[0]  # exactly one: the CLI checks
        self.run_id = watch.effective_run_id
        self.watch_dir = Path(watch.dir)
        env = {
            **os.environ,
            "CKPTD_RUN": self.run_id,
            "CKPTD_WATCH_DIR": str(self.watch_dir),
            "CKPTD_SIGNAL": settings.trainer.signal,
        }
        token = read_token(settings.http)  # token_file too; never on a command line
        if token:
            env["CKPTD_TOKEN"] = token
        self.trainer_pidfile = Path(settings.state.dir) / leftover.PIDFILE
        self.supervisor = TrainerSupervisor(
            command,
            run_id=self.run_id,
            env=env,
            policy=policy,
            metrics=self.metrics,
            resume_point=lambda: self.newest_complete(self.run_id),
            match=settings.trainer.match,
            save_signal=settings.trainer.signal_number,
            # Ship what it left at once: file events can be missed (a watch set up late).
            on_exit=lambda: self.tiers.rescan(self.run_id),
            on_restart=lambda cause: self.advisor.record_interruption(
                "restart", cause, self.run_id
            ),
            on_started=self._trainer_started,
            on_ended=self._trainer_ended,
            stopped_for_drill=self._stopped_for_drill,
            pidfile=self.trainer_pidfile,
            clock=clock,
        )
        self.goodput = GoodputRecorder(
            self.run_id,
            self.watch_dir,
            self.advisor.repo,
            Path(settings.state.dir),
            # With many nodes on one host (a test, a node shared by jobs) each keeps a lane.
            self.advisor.host
            if settings.cluster.nodes == 1
            else f"{self.advisor.host}#{settings.cluster.rank}",
            clock=clock,
        )
        self.responder.trainer_pids = self.supervisor.trainer_pids
        # Ctrl-C on a terminal is a notice too: the trainer saves before the end.
        self.sigint_source = SigtermSource(
            grace=shutdown_timeout, signum=signal.SIGINT, on_repeat=self.request_stop
        )
        self.noticed = asyncio.Event()
        self.responding = False
        self.restored: dict[str, Any] | None = None
        self._commit_seen: str | None = None  # the last commit marked in the run ledger
        self._drill_began: float | None = None  # the drill the trainer stopped for (wall)
        # The live line's head is a rollback of this node's trainer that LATEST does not
        # follow yet (set with each resume point).
        self._ahead_of_latest = False

    # -- lifecycle -----------------------------------------------------------------------

    async def serve(self) -> int:
        try:
            await self.startup()
            return await self.exec_loop()
        finally:
            await self.supervisor.stop(TRAINER_STOP_GRACE_SECONDS)  # never left running
            self.sigint_source.close()
            await self.shutdown()

    async def startup(self) -> None:
        # A trainer a previous exec left running (killed with -9, say) goes first: two
        # would write into one watch dir. The state dir's lock, taken at build, says no
        # live exec owns it.
        await asyncio.to_thread(leftover.end_leftover, self.trainer_pidfile, self.log)
        await super().startup()
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        self.sigint_source.install()
        if self.http_port is not None:
            host = self.settings.metrics.host
            host = "127.0.0.1" if host in ("", "0.0.0.0") else host
            host = f"[{host}]" if ":" in host else host
            self.supervisor.env["CKPTD_URL"] = f"http://{host}:{self.http_port}/v1/preemption"

    async def exec_loop(self) -> int:
        # Made now, so the watcher sees the trainer's first save as it happens.
        self.watch_dir.mkdir(parents=True, exist_ok=True)
        await self.goodput.load()
        await self.restore_newest()
        main = asyncio.create_task(self.main_loop(), name="main")
        recorder = asyncio.create_task(self._record_goodput(), name="goodput")
        trainer = asyncio.create_task(self.supervisor.run(), name="trainer")
        noticed = asyncio.ensure_future(self.noticed.wait())
        stopped = asyncio.ensure_future(self.stop_event.wait())
        try:
            await asyncio.wait([trainer, noticed, stopped], return_when=asyncio.FIRST_COMPLETED)
            if self.noticed.is_set() and not self.stop_event.is_set():
                code = await self._flush_on_notice(trainer)
            elif trainer.done() and not self.stop_event.is_set():
                code = trainer.result()
                await self._drain_after_sigterm("trainer_exit")  # what it left complete
                if code == 0:
                    self.goodput.finished()
            else:
                code = EXIT_FLUSH_FAILED  # told to stop now: nothing was flushed on purpose
        finally:
            recorder.cancel()
            noticed.cancel()
            stopped.cancel()
            await self.supervisor.stop(TRAINER_STOP_GRACE_SECONDS)  # supervisor.run returns
            self.stop_event.set()
            await main
            # Its result, or its error, was taken above; only its end is awaited here.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await trainer
        self.goodput.stopped(f"exit:{code}")
        await self.goodput.ship()
        self.log.info("exec_exit", code=code)
        return code

    # -- goodput -------------------------------------------------------------------------

    async def _record_goodput(self) -> None:
        shipped = self.clock.monotonic()
        while True:
            await asyncio.sleep(GOODPUT_POLL_SECONDS)
            try:
                self.goodput.poll()
                self._note_commit()
                if self.clock.monotonic() - shipped >= GOODPUT_SHIP_SECONDS:
                    shipped = self.clock.monotonic()
                    await self.goodput.ship()
            except OSError as exc:
                self.log.warning("goodput_record_failed", error=str(exc))

    def _note_commit(self) -> None:
        """A commit mark for the timeline when the run's last commit is a new one (not
        the one the store held at start-up)."""
        last = self.pipeline.runs[self.run_id].last_committed or {}
        name, at = last.get("checkpoint"), epoch_of_timestamp(last.get("committed_at") or "")
        if name and name != self._commit_seen and at is not None and at >= self.goodput.began:
            self._commit_seen = name
            self.goodput.mark("commit", self.clock.time(), name, last.get("step"))

    def _trainer_started(self, step: int | None) -> None:
        self.goodput.exec_started(step)
        self._drill_cost()

    async def _stopped_for_drill(self) -> bool:
        """Whether the trainer's exit 0 was for a drill; if so, return once the drill's
        notice is over (at its commit, at most its deadline) and its notice file gone, so
        the trainer started again does not take it for a notice of its own."""
        if not self.responder.drilling(DRILL_EXIT_SECONDS):
            return False
        self._drill_began = self.responder.drill_noticed
        while self.responder.drilling(0.0) and not self.stop_event.is_set():
            await asyncio.sleep(0.1)
        await self.responder.settle()
        return True

    def _drill_cost(self) -> None:
        """The run ledger: from the drill's notice until its trainer is started again, the
        time is the drill's (its own cause, over the save and the restart within it)."""
        began, self._drill_began = self._drill_began, None
        if began is not None:
            self.goodput.interval("drill", began, self.clock.time(), "drill")

    def _trainer_ended(self, returncode: int, held: bool) -> None:
        cause = self.goodput.notice_cause if held else cause_of(returncode)
        self.goodput.trainer_ended(cause, interrupted=held or returncode != 0)

    # -- restore before the first start -----------------------------------------------

    async def restore_newest(self) -> None:
        """Restore the newest committed checkpoint into the watch dir, unless a complete
        local one is as new (``ckptd.supervision.exec_restore``, its steps). ExecError when
        the store cannot say what it holds: starting the trainer from scratch would train
        over the run's history."""
        local_path, local_step = await self.newest_complete(self.run_id)
        if self._ahead_of_latest:
            # This node's trainer rolled back and LATEST does not follow it yet (its first
            # save is not committed): restoring LATEST would hand it the line it left.
            self.log.info(
                "exec_restore_skipped",
                local=None if local_path is None else local_path.name,
                reason="the trainer's reported rollback is newer than LATEST",
            )
            return
        # Every tier, in order: the newest step in any, from the first holding it.
        stores = [
            TierStore(t.name, t.health.storage, c)
            for t, c in zip(self.tiers, tier_configs(self.settings), strict=True)
        ]
        manifest = await newest_committed(stores, self.run_id, local_path, self.log)
        if manifest is None:
            return
        needed, aside = await asyncio.to_thread(
            restore_needed, local_path, local_step, manifest, self.watch_dir, self.log
        )
        if not needed:
            assert local_path is not None
            self.log.info(
                "exec_restore_skipped", local=local_path.name, committed=manifest.checkpoint
            )
            self.restored = {"checkpoint": manifest.checkpoint, "skipped": True, "seconds": 0.0}
            return
        restore_start = self.clock.time()
        done = await restore_into(
            self.settings,
            stores,
            self.run_id,
            manifest,
            self.watch_dir,
            aside=aside,
            log=self.log,
        )
        self.restored = restored_status(done)
        self.advisor.record_restore(self.run_id, manifest.checkpoint, skipped=done.result.skipped)
        self.goodput.restored(
            restore_start, self.clock.time(), sources=(done.peer_bytes, done.store_bytes)
        )
        self.log.info("exec_restored", **self.restored)

    async def newest_complete(self, run_id: str) -> tuple[Path | None, int | None]:
        """Path and step of ``run_id``'s newest complete local checkpoint on the live line
        (None, None when there is none): where the trainer resumes (``ckptd.sync.resume``),
        never a higher step of a line a rollback abandoned. A newer one complete but for a
        quiet window is waited for, at most ``RESUME_SETTLE_MAX_SECONDS``."""
        state = self.pipeline.runs[run_id]
        on_line = await asyncio.to_thread(self._live_line, state)
        until = self.clock.monotonic() + RESUME_SETTLE_MAX_SECONDS
        while True:
            now_ns = int(self.clock.time() * 1e9)
            point = await asyncio.to_thread(
                find_resume_point, state.dir, state.watch.layout, state.rules, now_ns, on_line
            )
            wait = point.recheck_after
            if wait is None or self.clock.monotonic() + wait > until:
                break
            await asyncio.sleep(wait + 0.05)
        found = point.checkpoint
        return (None, None) if found is None else (found.path, found.step)

    def _live_line(self, state: RunState) -> Callable[[CheckpointListing], bool] | None:
        """Whether a local checkpoint is on the run's live line (``ckptd.sync.lineage``),
        None when no line is known; sets ``_ahead_of_latest``. Blocking.

        A report the last trainer wrote (a rollback) is decided first, before the next
        start's report replaces it. LATEST is read now; when the store cannot be read, the
        one this daemon last knew stands in (its own commits move it)."""
        lineage = state.lineage
        self._ahead_of_latest = False
        if lineage is None:
            return None
        lineage.refresh()
        live: Manifest | None
        try:
            latest = self.pipeline.repo.read_latest(state.run_id)
            live = (
                self.pipeline.repo.read_manifest(state.run_id, latest.checkpoint)
                if latest is not None
                else None
            )
        except (StorageError, ManifestError) as exc:
            live = state.previous
            self.log.warning(
                "resume_point_from_known_latest",
                run=state.run_id,
                error=str(exc),
                latest=None if live is None else live.checkpoint,
            )
        line = lineage.live_line(live)
        if line is None:
            return None
        head = lineage.live_head(live)
        self._ahead_of_latest = (
            live is not None and head is not None and head.generation > live.lineage.generation
        )
        return lineage.on_line(line, live)

    # -- notices -------------------------------------------------------------------------

    def _notice_sources(self) -> list[NoticeSource]:
        return [self.sigint_source, *super()._notice_sources()]

    def _saves_only(self, notice: Notice, source: NoticeSource) -> bool:
        """Whether ``notice`` is another node's health save (or drill): the trainer
        saves, and the run goes on."""
        return source is self.notices.cluster_source and notice.kind in carried.ENDS_BY_ITSELF

    async def _on_notice(self, notice: Notice, source: NoticeSource) -> None:
        if self._saves_only(notice, source):
            # Another node's health save (or drill): save and go on, as the node it began
            # on does (its own reaches the responder directly, ckptd.daemon.health_loop);
            # no flush, no exit, the trainer not held.
            if self.responding:
                self.log.info("notice_ignored_already_responding", source=notice.source)
                return
            response = await self.notices.respond(notice, source)
            self.notices.end_followed_drill(notice, source, response)
            return
        current = self.responder.current
        if self.responding and current is not None and current.notice.id == notice.id:
            # The notice being flushed for, restated with another deadline: an update.
            await self.notices.respond(notice, source)
            return
        if self.responding:
            # One flush per exec: a second notice (SIGINT after SIGTERM) would replace the
            # response the flush is waiting on with one no save will ever complete.
            self.log.info("notice_ignored_already_responding", source=notice.source)
            return
        self.responding = True  # before the first await: a notice racing this one is dropped
        self.goodput.noticed(self.clock.time(), notice.source)
        # Held first: a trainer that exits on the signal must not be started again.
        self.supervisor.hold()
        # The many-node rules (no echo of another node's notice) hold here too.
        await self.notices.respond(notice, source)
        self.noticed.set()

    async def _flush_on_notice(self, trainer: asyncio.Task[int]) -> int:
        """Wait for the emergency checkpoint to be committed (or for it to be clear that
        none is coming), then stop the trainer. 0 when committed, or safe on its peers by
        the deadline; else EXIT_FLUSH_FAILED."""
        response = self.responder.current
        deadline = self.clock.monotonic() + self.shutdown_timeout
        if response is not None:
            left = response.notice.seconds_left(datetime.fromtimestamp(self.clock.time(), UTC))
            if left is not None:
                deadline = min(deadline, self.clock.monotonic() + left)
        pipeline, stop, clock, log = self.pipeline, self.stop_event, self.clock, self.log
        committed = await await_emergency(
            response,
            trainer,
            pipeline=pipeline,
            destination=self.destination,
            stop=stop,
            clock=clock,
            deadline=deadline,
            log=log,
        )
        if trainer.done() is False:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(trainer), TRAINER_STOP_GRACE_SECONDS)
        await self.supervisor.stop(TRAINER_STOP_GRACE_SECONDS)
        if committed and response is not None:
            await await_newer_saves(
                response, pipeline=pipeline, stop=stop, clock=clock, deadline=deadline, log=log
            )
        self._note_commit()
        self.goodput.flushed()
        # Safe off the node counts as flushed: acknowledged by peers.copies peers, which
        # hand it to the store if this node dies first (ckptd.sync.handoff).
        on_peers = response is not None and response.safe_via == "peer"
        safe_via = "store" if committed else ("peer" if on_peers else None)
        if response is not None and response.safe is not None and response.safe_via:
            # The run ledger shows which way it was safe first, and when.
            at = self.clock.time() - (self.clock.monotonic() - response.safe)
            self.goodput.mark("safe", at, f"{response.safe_via}:{response.checkpoint}")
        self.log.log(
            20 if safe_via else 40,
            "exec_preempted",
            emergency_checkpoint=response.checkpoint if response else None,
            committed=committed,
            safe_via=safe_via,
        )
        return 0 if safe_via else EXIT_FLUSH_FAILED

    # -- what HTTP shows -----------------------------------------------------------------

    def goodput_status(self) -> dict[str, Any]:
        """``/v1/status``'s ``goodput``: the run since its start and over the last day."""
        run = self.goodput.summary()
        day = self.goodput.summary(since=self.clock.time() - DAY_SECONDS)
        for cause, seconds in run.seconds.items():
            self.metrics.badput_seconds.labels(run=self.run_id, cause=cause).set(seconds)
        if run.ratio is not None:
            self.metrics.goodput_ratio.labels(run=self.run_id).set(run.ratio)
        return {"run": run.to_json(), "last_24h": day.to_json()}

    def status(self) -> dict[str, Any]:
        body = super().status()
        body["trainer"] = {**self.supervisor.status(), "restored": self.restored}
        body["goodput"] = self.goodput_status()
        return body
