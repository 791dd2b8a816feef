"""The trainer as the daemon's child (``ckptd exec``): start it, see it end, start it again.

Invariants:
- At most one trainer runs at a time. Each start gets ``CKPTD_RESUME_FROM`` = the newest
  complete local checkpoint (by the run's completion rule) on the run's live line (never a
  higher step of a line a rollback abandoned: ``ckptd.sync.resume``), or no such variable.
  Its resume report says ``"by": "ckptd"``: ckptd's choice, which continues the line it
  was taken from, never the trainer's rollback (``ckptd.sync.lineage``).
- The trainer runs in its own session and process group (so a terminal's Ctrl-C reaches
  ckptd only, and ckptd decides what the trainer hears). Its end is seen at once: asyncio's
  child watcher waits on the PID, nothing polls. What is left of its process group then
  gets SIGKILL, so no orphaned rank keeps writing into the watch dir or holding memory
  while its successor starts. While it runs, ``pidfile`` names it, so that the next exec
  can end it if this one dies first (``ckptd.supervision.leftover``).
- Whether and when to start again is ``ckptd.supervision.restarts.decide`` (pure); once ``hold()`` is
  called (a notice, a shutdown) nothing is started again. A trainer that exits 0 because a
  drill asked it to save (``stopped_for_drill``) is started again at once: a drill is
  neither a failure nor the run's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptd.core import handoff
from ckptd.core.errors import EXIT_GAVE_UP, EXIT_USAGE, CkptdError
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.runtime.processes import PROC, all_stat_fields, catches_signal, cmdline_of
from ckptd.supervision import leftover
from ckptd.supervision.restarts import Attempt, RestartPolicy, cause_of, decide, shell_code

#: What a resume-point lookup answers: the checkpoint's path and step (path None: none).
ResumeLookup = Callable[[], Awaitable[tuple[Path | None, int | None]]]


def process_tree(root: int, *, proc: Path = PROC) -> list[int]:
    """``root`` and every live descendant of it (a snapshot of /proc; racy by nature)."""
    children: dict[int, list[int]] = {}
    for pid, fields in all_stat_fields(proc=proc):
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return [p for p in found if p == root or (proc / str(p)).exists()]


def signal_targets(root: int, signum: int, match: str = "", *, proc: Path = PROC) -> list[int]:
    """Whom a notice may signal in ``root``'s tree (``TrainerSupervisor.trainer_pids``);
    the responder still spares any of them that has no handler for the signal."""
    tree = process_tree(root, proc=proc)
    if match:
        return [p for p in tree if match in cmdline_of(p, proc=proc)]
    return [p for p in tree if catches_signal(p, signum, proc=proc)] or [root]


class TrainerStartError(CkptdError):
    """The trainer command cannot be run at all (exit 2: bad usage)."""

    exit_code = EXIT_USAGE


class TrainerSupervisor:
    """Runs ``command`` until it finishes, is given up on, or ``hold()`` + ``stop()``."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        run_id: str,
        env: Mapping[str, str],
        policy: RestartPolicy,
        metrics: Metrics,
        resume_point: ResumeLookup,
        match: str = "",
        save_signal: int = signal.SIGUSR1,
        on_exit: Callable[[], Awaitable[None]] | None = None,
        on_restart: Callable[[str], None] | None = None,
        on_started: Callable[[int | None], None] | None = None,
        on_ended: Callable[[int, bool], None] | None = None,
        stopped_for_drill: Callable[[], Awaitable[bool]] | None = None,
        pidfile: Path | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.command = list(command)
        self.run_id = run_id
        self.env = dict(env)
        self.policy = policy
        self.metrics = metrics
        self.resume_point = resume_point
        self.match = match
        self.save_signal = save_signal  # trainer.signal: what asks the trainer to save
        self.on_exit = on_exit  # after each exit: let the daemon look for what it left
        self.on_restart = on_restart  # each restart, with its cause: an interruption record
        self.on_started = on_started  # each start, with the step it resumes from (goodput)
        self.on_ended = on_ended  # each end: its return code, and whether held (goodput)
        # Whether an exit 0 now is the trainer stopping for a drill (then: start it again,
        # once the drill's notice is over).
        self.stopped_for_drill = stopped_for_drill
        self.pidfile = pidfile  # names the running trainer (ckptd.supervision.leftover)
        self.clock = clock
        self.log = get_logger(run=run_id)
        self.proc: asyncio.subprocess.Process | None = None
        self.history: list[Attempt] = []
        self.starts = 0
        self.restarts = 0
        self.running_since: float | None = None  # wall clock
        self.resumed_from: str | None = None
        self.last_exit: dict[str, Any] | None = None
        self.gave_up: str | None = None
        self.exit_code: int | None = None
        self.restart_seconds: list[float] = []  # crash seen -> next trainer started
        self._held = asyncio.Event()

    # -- what the daemon asks ------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def trainer_pids(self) -> list[int]:
        """Whom a notice signals: the trainer and its descendants (all ranks under a
        launcher), narrowed to command lines containing ``trainer.match`` when set.

        Without ``match``, only the processes that catch ``signal`` (a handler is
        installed: the ranks' listeners) are signalled, so a launcher that would die of
        it, such as torchrun (it handles SIGTERM, SIGINT, SIGHUP, SIGQUIT, not SIGUSR1), is
        left out; when none catches it yet (a trainer still starting), the trainer itself
        is named, and the responder spares it as it spares any process without a handler
        (it learns of the notice from its notice file)."""
        pid = self.pid
        if pid is None:
            return []
        return signal_targets(pid, self.save_signal, self.match)

    def status(self) -> dict[str, Any]:
        """The ``trainer`` object of ``/v1/status``."""
        return {
            "command": self.command,
            "pid": self.pid,
            "starts": self.starts,
            "restarts": self.restarts,
            "max_restarts": self.policy.max_restarts,
            "running_since": self.running_since if self.pid is not None else None,
            "resumed_from": self.resumed_from,
            "last_exit": self.last_exit,
            "last_restart_seconds": self.restart_seconds[-1] if self.restart_seconds else None,
            "gave_up": self.gave_up,
            "held": self._held.is_set(),
        }

    def hold(self) -> None:
        """Start nothing again from now on (a notice or a shutdown is under way)."""
        self._held.set()

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> int:
        """Start, watch and restart the trainer; the exit code ``ckptd exec`` should end with."""
        crashed_at: float | None = None
        path, step = await self.resume_point()
        while not self._held.is_set():
            started = self.clock.monotonic()
            await self._start(path, step)
            if crashed_at is not None:
                seconds = self.clock.monotonic() - crashed_at
                self.restart_seconds.append(seconds)
                self.metrics.trainer_restart_seconds.labels(run=self.run_id).observe(seconds)
                self.log.warning(
                    "trainer_restarted",
                    pid=self.pid,
                    restarts=self.restarts,
                    resume_from=self.resumed_from,
                    seconds_since_crash=round(seconds, 3),
                )
            assert self.proc is not None
            returncode = await self.proc.wait()
            ended = self.clock.monotonic()
            self._kill_group(self.proc.pid)
            self.metrics.trainer_running.labels(run=self.run_id).set(0)
            if self.on_ended is not None:
                self.on_ended(returncode, self._held.is_set())
            if self.on_exit is not None:
                try:
                    await self.on_exit()
                except OSError as exc:
                    self.log.warning("trainer_exit_rescan_failed", error=str(exc))
            self.last_exit = {
                "code": returncode,
                "cause": cause_of(returncode),
                "at": self.clock.time(),
                "ran_seconds": round(ended - started, 3),
            }
            if self._held.is_set():
                self.log.info("trainer_exited", cause=cause_of(returncode), held=True)
                self.exit_code = shell_code(returncode)
                return self.exit_code
            if await self._drilled(returncode):  # started again, from its checkpoint
                crashed_at, (path, step) = None, await self.resume_point()
                continue
            new_path, new_step = await self.resume_point()
            attempt = Attempt(returncode, ended - started, self._newer(new_path, new_step, step))
            self.history.append(attempt)
            decision = decide(self.history, self.restarts, self.policy)
            self.log.log(
                20 if returncode == 0 else 40,
                "trainer_exited",
                cause=attempt.cause,
                ran_seconds=round(attempt.seconds, 3),
                progressed=attempt.progressed,
                newest_checkpoint=None if new_path is None else str(new_path),
                decision=decision.reason,
                restart_in=decision.delay if decision.restart else None,
            )
            if not decision.restart:
                if attempt.failed:
                    self.gave_up = decision.reason
                    # --max-restarts 0 asks for no supervision: the trainer's own code.
                    self.exit_code = (
                        shell_code(returncode) if self.policy.max_restarts == 0 else EXIT_GAVE_UP
                    )
                    self.log.error("trainer_given_up", reason=decision.reason, exit=self.exit_code)
                else:
                    self.exit_code = 0
                return self.exit_code
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._held.wait(), timeout=decision.delay)
            if self._held.is_set():
                break
            self.restarts += 1
            self.metrics.trainer_restarts.labels(run=self.run_id, cause=attempt.cause).inc()
            if self.on_restart is not None:
                self.on_restart(attempt.cause)
            crashed_at = ended
            path, step = await self.resume_point() if decision.delay else (new_path, new_step)
        self.exit_code = shell_code(self.history[-1].returncode) if self.history else 0
        return self.exit_code

    async def _drilled(self, returncode: int) -> bool:
        """An exit 0 while a drill asked the trainer to save: it stopped as after a notice,
        and starts again from that checkpoint once the drill's notice is over, as a
        resumed trainer does after a preemption; neither a failure nor the run's end."""
        if returncode != 0 or self.stopped_for_drill is None:
            return False
        drill = await self.stopped_for_drill()
        if drill:
            self.log.warning("trainer_stopped_for_drill", restart="from its checkpoint")
        return drill

    @staticmethod
    def _newer(path: Path | None, step: int | None, before: int | None) -> bool:
        if path is None:
            return False
        if before is None:
            return True
        return step is not None and step > before

    async def _start(self, path: Path | None, step: int | None) -> None:
        env = dict(self.env)
        env.pop("CKPTD_RESUME_FROM", None)
        if path is not None:
            env["CKPTD_RESUME_FROM"] = str(path)
        self.resumed_from = None if path is None else path.name
        self._report_resumed(env)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command, env=env, start_new_session=True
            )
        except OSError as exc:  # not found, not executable: no restart can help
            raise TrainerStartError(
                f"cannot run the trainer {self.command[0]!r}: {exc.strerror or exc}; "
                "check the command after --"
            ) from exc
        if self.pidfile is not None:
            try:
                leftover.record(self.pidfile, self.proc.pid)
            except OSError as exc:  # a full or read-only state dir: supervision goes on
                self.log.warning("trainer_pidfile_failed", error=str(exc))
        self.starts += 1
        if self.on_started is not None:
            self.on_started(step)
        self.running_since = self.clock.time()
        self.metrics.trainer_starts.labels(run=self.run_id).inc()
        self.metrics.trainer_running.labels(run=self.run_id).set(1)
        self.log.info(
            "trainer_started",
            pid=self.proc.pid,
            attempt=self.starts,
            resume_from=None if path is None else str(path),
            step=step,
        )

    def _report_resumed(self, env: dict[str, str]) -> None:
        """What this start resumes from, in the trainer's resume report (the trainer's own
        report, if it makes one, comes later and is believed over this): the daemon
        decides the trajectory of its saves from it (``ckptd.sync.lineage``)."""
        where = env.get("CKPTD_WATCH_DIR")
        if not where:
            return
        document = {
            "checkpoint": self.resumed_from,
            "pid": 0,
            "at": self.clock.time(),
            "by": handoff.RESUMED_BY_CKPTD,
        }
        try:
            handoff.replace_json(Path(where) / handoff.RESUMED, document)
        except OSError as exc:
            self.log.warning("resume_report_failed", error=str(exc))

    # -- stopping ------------------------------------------------------------------------

    async def stop(self, grace: float) -> None:
        """Hold, then end the trainer: SIGTERM to its tree, SIGKILL after ``grace``."""
        self.hold()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        pids = process_tree(proc.pid)
        self.log.warning("trainer_stopping", pids=pids, grace=grace)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=grace)
        except TimeoutError:
            self.log.error("trainer_killed", pid=proc.pid, after_seconds=grace)
            for pid in [*process_tree(proc.pid), proc.pid]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            await proc.wait()
        self._kill_group(proc.pid)

    def _kill_group(self, pgid: int) -> None:
        """SIGKILL whatever is left of the trainer's process group (module doc); then
        nothing of it runs, and ``pidfile`` no longer names it."""
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
        if self.pidfile is not None:
            leftover.clear(self.pidfile)
