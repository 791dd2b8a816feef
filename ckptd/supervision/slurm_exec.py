"""``ckptd exec`` inside a Slurm job: SIGTERM's deadline from Slurm, one interruption
acted on, and the job requeued once its emergency checkpoint is committed.

    start-up   as ``ckptd exec``; ``[slurm] signal`` is caught from here on (only logged
               until the notice loop's Slurm source starts); SIGTERM's grace is ``[slurm] grace_seconds``, else
               the job's partition's ``GraceTime``, else ``KillWait`` (a preempted
               ``srun`` step gets SIGTERM, then SIGKILL after that grace)
    restore    as on a fresh node; the step it resumes from is kept (``progressed`` below).
               A requeued attempt (``SLURM_RESTART_COUNT`` > 0) is no different
    notices    the first one is acted on (the time limit, a preemption, the user's signal,
               SIGTERM, a cloud's); any later one is logged and ignored, so the response
               being waited for is never replaced
    end        as ``ckptd exec``, then ``ckptd.supervision.requeue`` decides (with many
               nodes, node 0's alone: one requeue per job); to requeue, SIGTERM is
               ignored from here on (Slurm sends SIGCONT + SIGTERM to the job within
               milliseconds of ``scontrol requeue``, to ``scontrol`` too, which inherits
               the ignoring) and ``scontrol requeue $SLURM_JOB_ID`` is run; the exit
               code is ``ckptd exec``'s own
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from signal import Signals

from ckptd.config import Settings
from ckptd.layouts.base import step_of
from ckptd.notices.model import Notice, NoticeSource
from ckptd.notices.slurm import SlurmError, read_grace_seconds, read_job, scontrol
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.supervision.exec_service import SupervisedService
from ckptd.supervision.requeue import classify, decide_requeue
from ckptd.supervision.restarts import RestartPolicy


class SlurmSupervisedService(SupervisedService):
    """``ckptd exec`` in Slurm job ``job_id`` (module doc)."""

    def __init__(
        self,
        settings: Settings,
        command: Sequence[str],
        *,
        job_id: str,
        restart_count: int,
        policy: RestartPolicy,
        shutdown_timeout: float = 60.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(
            settings, command, policy=policy, shutdown_timeout=shutdown_timeout, clock=clock
        )
        self.job_id = job_id
        self.restart_count = restart_count
        self.interruption: Notice | None = None
        self.started_step: int | None = None
        self.requeued: bool | None = None

    async def startup(self) -> None:
        await super().startup()
        # Until the notice loop's Slurm source takes it over, [slurm] signal must not kill
        # ckptd (its default action) while the restore runs; the time limit and a
        # preemption are still read from Slurm when the source starts.
        signum = Signals[self.settings.slurm.signal]
        asyncio.get_running_loop().add_signal_handler(
            signum, lambda: self.log.warning("slurm_signal_before_watch", signal=signum.name)
        )
        grace: float | None = self.settings.slurm.grace_seconds or None
        partition = ""
        try:
            job = await asyncio.to_thread(read_job, self.job_id)
            partition = job.partition
            if grace is None:
                grace = await asyncio.to_thread(read_grace_seconds, partition)
        except SlurmError as exc:
            self.log.warning("slurm_job_unreadable", job=self.job_id, error=str(exc))
        if grace:
            self.sigterm_source.grace = timedelta(seconds=grace)
        self.log.info(
            "slurm_job",
            job=self.job_id,
            restart_count=self.restart_count,
            partition=partition,
            sigterm_grace_seconds=self.sigterm_source.grace.total_seconds(),
        )

    async def restore_newest(self) -> None:
        await super().restore_newest()
        _, self.started_step = await self.newest_complete(self.run_id)

    async def _on_notice(self, notice: Notice, source: NoticeSource) -> None:
        if self._saves_only(notice, source):
            await super()._on_notice(notice, source)  # no interruption: the job goes on
            return
        if self.interruption is not None:
            self.log.info(
                "notice_ignored_already_responding",
                source=notice.source,
                kind=notice.kind,
                responding_to=self.interruption.kind,
            )
            return
        self.interruption = notice
        await super()._on_notice(notice, source)

    async def serve(self) -> int:
        code = await super().serve()
        if await asyncio.to_thread(self.requeue_due, code):
            # Slurm's SIGTERM to the job follows at once; ckptd has nothing left to do.
            # (Here, in the main thread: Python sets handlers nowhere else.)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.requeued = await asyncio.to_thread(self.requeue)
        return code

    def requeue_due(self, code: int) -> bool:
        """Whether ``ckptd.supervision.requeue`` says to requeue this job (logged)."""
        notice = self.interruption
        job = None
        if notice is not None:
            try:
                job = read_job(self.job_id)
            except SlurmError as exc:
                self.log.error("slurm_job_unreadable", job=self.job_id, error=str(exc))
        now = datetime.fromtimestamp(self.clock.time(), UTC)
        kind = classify(
            notice.source if notice else None,
            notice.kind if notice else None,
            preempted=job is not None and job.preempted,
            past_end=job is not None and job.end_time is not None and job.end_time <= now,
        )
        response = self.responder.current
        committed = code == 0 and response is not None and response.committed is not None
        step = step_of(response.checkpoint) if response and response.checkpoint else None
        progressed = step is not None and (self.started_step is None or step > self.started_step)
        cluster = self.settings.cluster
        decision = decide_requeue(
            # One requeue per job: node 0's (the others' would be refused as too late).
            self.settings.slurm.requeue if cluster.rank == 0 else "never",
            kind,
            requeueable=job is not None and job.requeue,
            committed=committed,
            progressed=progressed,
        )
        self.log.info(
            "slurm_requeue_decision",
            job=self.job_id,
            interruption=kind,
            requeue=decision.requeue,
            reason=decision.reason,
            emergency_checkpoint=response.checkpoint if response else None,
            started_step=self.started_step,
        )
        self.requeued = False if not decision.requeue else None
        return decision.requeue

    def requeue(self) -> bool:
        """``scontrol requeue $SLURM_JOB_ID``; False (logged) when Slurm refuses."""
        try:
            scontrol("requeue", self.job_id)
        except SlurmError as exc:
            self.log.error("slurm_requeue_failed", job=self.job_id, error=str(exc))
            return False
        self.log.warning("slurm_requeued", job=self.job_id)
        return True
