"""Slurm as a notice source: the job's time limit, its preemption, and a user's signal.

Inside a Slurm job (``SLURM_JOB_ID``) a job ends three ways that training can see coming:

- its **time limit**, known from the start: ``EndTime`` of ``scontrol show job``
  (``ckptd.notices.slurm_job``). The source re-reads it every ``poll_interval_seconds``
  (``scontrol update TimeLimit=`` moves it) and yields a ``time-limit`` notice ``lead``
  seconds before it, with ``EndTime`` as deadline; no ``--signal`` is needed;
- **preemption** by a higher-priority job: Slurm sets ``PreemptTime`` and moves
  ``EndTime`` to ``PreemptTime + GraceTime``; a batch script gets no signal until the grace
  period is over (without ``preempt_send_user_signal``), so the same re-read yields a
  ``preemption`` notice whose deadline is that ``EndTime``. A step run by ``srun`` gets
  SIGTERM at once: the daemon's own SIGTERM notice, whose grace ``grace_seconds`` gives
  (the partition's ``GraceTime``, else ``KillWait``);
- a **user signal** (``sbatch --signal=B:USR1@N``, ``scancel --signal=USR1 --batch``):
  ``slurm.signal`` is caught and yields a ``user-signal`` notice, deadline ``EndTime``.

Each notice is yielded once (its id names the job and the time or signal count). An
``scontrol`` that fails or times out is logged, rate-limited, and the last known end is
kept: the time limit's notice does not depend on the controller answering on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import datetime
from signal import Signals
from typing import Any

import structlog

from ckptd.notices.health import SourceHealth
from ckptd.notices.model import Clock, Notice, RateLimitedLog, utc_now
from ckptd.notices.slurm_job import (
    JobState,
    SlurmParseError,
    job_id_of,
    parse_config_seconds,
    parse_grace_seconds,
    parse_job,
    save_due_at,
)

log = structlog.get_logger("ckptd.notices.slurm")

SCONTROL_TIMEOUT_SECONDS = 10.0


def scontrol(*args: str, timeout: float = SCONTROL_TIMEOUT_SECONDS) -> str:
    """``scontrol -o ARGS``'s output; SlurmError when it cannot be run or fails."""
    path = shutil.which("scontrol")
    if path is None:
        raise SlurmError("scontrol is not on PATH")
    try:
        done = subprocess.run(
            [path, "-o", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SlurmError(f"scontrol {' '.join(args)}: {exc}") from exc
    if done.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


class SlurmError(Exception):
    """A Slurm command could not be run or failed (the source keeps going)."""


def read_job(job_id: str) -> JobState:
    """The job as ``scontrol show job`` has it now."""
    try:
        return parse_job(scontrol("show", "job", job_id))
    except SlurmParseError as exc:
        raise SlurmError(str(exc)) from exc


def read_grace_seconds(partition: str) -> float | None:
    """The seconds between a preemption's SIGTERM and its SIGKILL for ``partition``: its
    ``GraceTime``, else the cluster's ``KillWait``; None when Slurm cannot say."""
    try:
        grace = parse_grace_seconds(scontrol("show", "partition", partition))
        if grace:
            return grace
        return parse_config_seconds(scontrol("show", "config"), "KillWait")
    except SlurmError as exc:
        log.warning("slurm_grace_unknown", partition=partition, error=str(exc))
        return None


class SlurmJobSource:
    """Yields the job's time limit, preemption and user signals as notices (module doc)."""

    name = "slurm"

    def __init__(
        self,
        job_id: str,
        *,
        lead: Callable[[], float],
        poll_interval: float = 5.0,
        signum: int = signal.SIGUSR1,
        clock: Clock = utc_now,
        read: Callable[[str], JobState] = read_job,
    ) -> None:
        self.job_id = job_id
        self.lead = lead  # seconds before the end that a forced save starts (re-asked)
        self.poll_interval = poll_interval
        self.signum = signum
        self._clock = clock
        self._read = read
        self._log = RateLimitedLog(log)
        # Up once the job was read; deaf (``/readyz``) after 3 failed reads in a row:
        # the time limit and a preemption are then no longer seen coming.
        self.health = SourceHealth(self.name)
        self.job: JobState | None = None  # as last read
        self._signals = 0
        self._woken = asyncio.Event()
        self._yielded: set[str] = set()

    async def acknowledge(self, notice: Notice) -> None:
        """Nothing to acknowledge."""

    def _on_signal(self) -> None:
        self._signals += 1
        self._woken.set()

    async def _refresh(self) -> None:
        try:
            self.job = await asyncio.to_thread(self._read, self.job_id)
            self.health.succeeded("scontrol")
            self._log.recovered("scontrol", "slurm_job_readable", job=self.job_id)
        except SlurmError as exc:
            self.health.failed("scontrol", str(exc))
            self._log.warning("scontrol", "slurm_job_unreadable", job=self.job_id, error=str(exc))

    def due(self, now: datetime) -> list[Notice]:
        """The notices due now from what was last read and the signals received."""
        job = self.job
        end = job.end_time if job is not None else None
        out: list[Notice] = []
        detail: dict[str, Any] = {"job_id": self.job_id}
        if job is not None:
            detail |= {"partition": job.partition, "restarts": job.restarts}
        if self._signals:
            out.append(
                Notice(
                    "slurm",
                    "user-signal",
                    f"slurm:{self.job_id}:signal:{self._signals}",
                    now,
                    end if end is not None and end > now else None,
                    detail | {"signal": Signals(self.signum).name},
                )
            )
        if job is not None and job.preempted and end is not None:
            out.append(
                Notice(
                    "slurm",
                    "preemption",
                    f"slurm:{self.job_id}:preempt:{job.preempt_time}",
                    now,
                    end,
                    detail | {"preempt_time": str(job.preempt_time)},
                )
            )
        elif job is not None and end is not None:
            due = save_due_at(job, self.lead())
            if due is not None and now >= due:
                out.append(
                    Notice(
                        "slurm",
                        "time-limit",
                        f"slurm:{self.job_id}:time-limit:{end.isoformat()}",
                        now,
                        end,
                        detail | {"lead_seconds": round((end - now).total_seconds(), 3)},
                    )
                )
        return [n for n in out if n.id not in self._yielded]

    def _sleep_for(self, now: datetime) -> float:
        """Until the next read, or the forced save's time if that comes first."""
        wait = self.poll_interval
        job = self.job
        if job is not None:
            due = save_due_at(job, self.lead())
            if due is not None:
                wait = min(wait, max(0.05, (due - now).total_seconds()))
        return wait

    async def watch(self) -> AsyncIterator[Notice]:
        """Read the job every ``poll_interval`` and yield what is due (module doc)."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(self.signum, self._on_signal)
        try:
            while True:
                await self._refresh()
                now = self._clock()
                for notice in self.due(now):
                    self._yielded.add(notice.id)
                    yield notice  # logged once, by the responder (notice_received)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), self._sleep_for(self._clock()))
                self._woken.clear()
        finally:
            loop.remove_signal_handler(self.signum)


def make_slurm_source(
    enabled: str,
    environ: Mapping[str, str],
    *,
    lead: Callable[[], float],
    poll_interval: float,
    signal_name: str,
) -> SlurmJobSource | None:
    """The job's source when this process runs inside a Slurm job and ``[slurm] enabled``
    is ``auto``; None otherwise. Construction does no I/O."""
    job_id = job_id_of(environ)
    if enabled == "off" or job_id is None:
        return None
    return SlurmJobSource(
        job_id, lead=lead, poll_interval=poll_interval, signum=Signals[signal_name]
    )
