"""``ckptd exec``: the daemon plus the trainer as its supervised child."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.cli.errors import UsageError
from ckptd.cli.invocation import settings_of
from ckptd.cli.options import add_common, at_least
from ckptd.config import ConfigError, require_destination, require_watch
from ckptd.core.errors import EXIT_FLUSH_FAILED, EXIT_GAVE_UP
from ckptd.notices.slurm_job import job_id_of
from ckptd.supervision.restarts import DEFAULT_MAX_RESTARTS, RestartPolicy

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers

EXEC_EPILOG = f"""\
Restores the run's newest committed checkpoint into the watch dir (unless a complete local
one is as new), then runs CMD with CKPTD_RESUME_FROM (the newest complete local checkpoint
of the run's live line, never a higher step of a line a rollback abandoned; unset when
none), CKPTD_RUN and CKPTD_WATCH_DIR, ships its checkpoints, and starts it again from the
newest complete checkpoint of that line when it exits non-zero or dies by a signal.
SIGTERM, SIGINT and cloud notices make CMD save (trainer.signal), then ckptd commits that
checkpoint, stops CMD and exits. Inside a Slurm job the time limit, a preemption and
slurm.signal are notices too, and the job is requeued after its emergency checkpoint is
committed (slurm.requeue; docs/slurm.md).

exit codes:
  CMD's own     CMD finished by itself (0 included; with --max-restarts 0, any code)
  0             preempted, and the emergency checkpoint was committed
  {EXIT_FLUSH_FAILED}            preempted, and the emergency checkpoint was NOT committed
  {EXIT_GAVE_UP}            gave up: --max-restarts used up, or CMD failed at start-up
                {RestartPolicy.startup_attempts} times in a row, or {RestartPolicy.same_failure_attempts} times with the same cause and no new checkpoint
  1 / 2         ckptd could not start (store unreadable) / bad usage or config
"""


def add_parser(sub: Subparsers) -> None:
    exe = sub.add_parser(
        "exec",
        help="the daemon plus the trainer as its supervised child",
        usage="ckptd exec [options] -- CMD [ARG...]",
        epilog=EXEC_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(exe, log_level="info")
    exe.add_argument("--watch", type=Path, default=None, help="local checkpoint dir")
    exe.add_argument("--run", dest="run_id", default=None, help="run id (default: its basename)")
    exe.add_argument("--layout", default=None, help="completion rule (default auto)")
    exe.add_argument("--state-dir", type=Path, default=None, help="journal directory")
    exe.add_argument(
        "--max-restarts",
        type=at_least(0),
        default=DEFAULT_MAX_RESTARTS,
        help=f"restarts after failures before giving up (default {DEFAULT_MAX_RESTARTS})",
    )
    exe.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        help="seconds to get the emergency checkpoint committed after SIGTERM/SIGINT",
    )
    exe.add_argument(
        "trainer_command", nargs=argparse.REMAINDER, metavar="CMD", help="the trainer, after --"
    )


def handle(args: argparse.Namespace) -> int:
    from ckptd.supervision.exec_service import SupervisedService

    command = list(args.trainer_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("no trainer command: ckptd exec [options] -- CMD [ARG...]")
    settings = settings_of(args)
    require_destination(settings)
    require_watch(settings)
    if len(settings.watch) != 1:
        raise ConfigError(
            "watch",
            f"ckptd exec supervises one trainer and needs exactly one [[watch]], "
            f"not {len(settings.watch)}; keep one, or give --watch DIR",
        )
    policy = RestartPolicy(max_restarts=args.max_restarts)
    job_id = job_id_of(os.environ)
    if job_id is not None and settings.slurm.enabled != "off":
        from ckptd.supervision.slurm_exec import SlurmSupervisedService

        restarts = os.environ.get("SLURM_RESTART_COUNT", "0").strip()
        service: SupervisedService = SlurmSupervisedService(
            settings,
            command,
            job_id=job_id,
            restart_count=int(restarts) if restarts.isdigit() else 0,
            policy=policy,
            shutdown_timeout=args.shutdown_timeout,
        )
    else:
        service = SupervisedService(
            settings, command, policy=policy, shutdown_timeout=args.shutdown_timeout
        )
    return asyncio.run(service.serve())
