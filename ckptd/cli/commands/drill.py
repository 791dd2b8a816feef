"""``ckptd drill``: a simulated preemption against the running daemon, followed the whole
way to a trainer that loads the checkpoint, with each stage's time; ``--restore-only``:
the restore-and-load half by itself, on any node that reaches the store, and with
``--resume-steps N -- CMD`` the trainer resumed from it for N steps. Exit 1 when any
stage failed (``ckptd.drill.model``), naming it, or when the run has nothing committed to
drill (nothing recorded then)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.cli.daemon_client import daemon_request
from ckptd.cli.errors import EXIT_OK, UsageError
from ckptd.cli.humanize import human_bytes
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import DAEMON_URL_HELP, JSON_HELP, add_common
from ckptd.core.errors import EXIT_FAILED

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers

# How each stage is shown (the first three as before the drill went past the commit).
LABELS = {
    "signalled": "trainer signalled",
    "complete": "checkpoint complete",
    "committed": "committed",
    "restored": "restored",
    "verified": "verified",
    "loaded": "loaded",
    "resumed": "resumed",
}
# How long `ckptd drill` waits for a restore and its verification (a socket's idle time).
PROOF_ALLOWANCE_SECONDS = 86400.0
# The flags that belong to --restore-only (a fresh node, no daemon).
RESTORE_ONLY_FLAGS = (
    "run_id",
    "checkpoint",
    "check",
    "scratch",
    "dest",
    "endpoint_url",
    "resume_steps",
    "resume_timeout",
    "resume_command",
)


def add_parser(sub: Subparsers) -> None:
    drill = sub.add_parser(
        "drill",
        help="simulated preemption against the running daemon, through restore and load, "
        "with timings",
    )
    add_common(drill)
    drill.add_argument(
        "--deadline",
        type=float,
        default=120.0,
        help="seconds the simulated notice gives (default %(default)g)",
    )
    drill.add_argument("--url", default=None, help=DAEMON_URL_HELP)
    drill.add_argument(
        "--restore-only",
        action="store_true",
        help="no daemon, no notice: restore the run's newest checkpoint into a scratch dir, "
        "verify every byte and run the load check, as a fresh node would",
    )
    drill.add_argument(
        "--run", dest="run_id", default=None, help="--restore-only: the run id (required)"
    )
    drill.add_argument(
        "--checkpoint", default=None, help="--restore-only: this checkpoint, not the newest"
    )
    drill.add_argument(
        "--check",
        default=None,
        metavar="COMMAND",
        help="--restore-only: the load check, one shell-quoted string (default: [drill] check)",
    )
    drill.add_argument(
        "--scratch",
        type=Path,
        default=None,
        metavar="DIR",
        help="--restore-only: restore under DIR (default: [drill] scratch_dir, else "
        "<state.dir>/drill)",
    )
    drill.add_argument(
        "--resume-steps",
        type=int,
        default=None,
        metavar="N",
        help="--restore-only: then start the trainer (the command after --, default: [drill] "
        "resume) from the restored checkpoint until it reports N steps (default: [drill] "
        "resume_steps; 0: no resume)",
    )
    drill.add_argument(
        "--resume-timeout",
        type=float,
        default=None,
        metavar="S",
        help="--restore-only: seconds the resumed trainer has for its steps (default: "
        "[drill] resume_timeout_seconds)",
    )
    drill.add_argument("--json", action="store_true", help=JSON_HELP)
    drill.add_argument(
        "resume_command",
        nargs=argparse.REMAINDER,
        metavar="CMD",
        help="--restore-only --resume-steps N: the trainer, after --",
    )


def handle(args: argparse.Namespace) -> int:
    command = list(args.resume_command)
    args.resume_command = command[1:] if command[:1] == ["--"] else command
    if args.restore_only:
        if not args.run_id:
            raise UsageError("--restore-only needs --run RUN")
        if args.resume_steps is not None and args.resume_steps < 0:
            raise UsageError("--resume-steps must be 0 or more")
        if args.resume_timeout is not None and not args.resume_timeout > 0:
            raise UsageError("--resume-timeout must be more than 0")
        doc = _restore_only(args)
    else:
        given = [_flag(name) for name in RESTORE_ONLY_FLAGS if getattr(args, name)]
        if given:
            raise UsageError(
                f"{', '.join(given)} apply to --restore-only; a drill without it asks the "
                "running daemon, which knows its store and its runs"
            )
        _, doc = daemon_request(
            args,
            f"/v1/drill?deadline={args.deadline}",
            failure="drill failed",
            method="POST",
            timeout=args.deadline + _proof_allowance(args),
        )
    ok = doc.get("result") == "success"
    if args.json:
        print_json(doc)
    else:
        _print(doc, args.deadline if not args.restore_only else None)
    return EXIT_OK if ok else EXIT_FAILED


def _flag(name: str) -> str:
    if name == "resume_command":
        return "a command after --"
    return "--" + name.removesuffix("_id").replace("_", "-")


def _proof_allowance(args: argparse.Namespace) -> float:
    """How long past the deadline the daemon may take to answer: the restore and the
    verification (a large checkpoint takes what the network gives it; a day at most
    here) and the load check (bounded by its timeout)."""
    return settings_of(args).drill.check_timeout_seconds + PROOF_ALLOWANCE_SECONDS


def _restore_only(args: argparse.Namespace) -> dict[str, Any]:
    from ckptd.drill.standalone import RestoreOnlyDrill, run_restore_only

    settings = settings_of(args)
    storage = tiers_of(args, settings)[0].storage
    config = settings.drill
    check = config.check if args.check is None else shlex.split(args.check)
    scratch = (
        args.scratch.expanduser().absolute()
        if args.scratch is not None
        else config.scratch(settings.state.dir)
    )
    resume = args.resume_command or config.resume
    steps = config.resume_steps if args.resume_steps is None else args.resume_steps
    if args.resume_command and not steps:
        raise UsageError("a command after -- is the trainer to resume: give --resume-steps N")
    if steps and not resume:
        raise UsageError(
            "--resume-steps needs the trainer's command: ckptd drill --restore-only --run RUN "
            "--resume-steps N -- CMD [ARG...] (or [drill] resume)"
        )
    record, key = run_restore_only(
        storage,
        RestoreOnlyDrill(
            args.run_id,
            args.checkpoint,
            scratch,
            check,
            config.check_timeout_seconds,
            concurrency=settings.destination.concurrency,
            keys=settings.authentication.key_ring(),
            resume=resume,
            resume_steps=steps,
            resume_timeout=args.resume_timeout or config.resume_timeout_seconds,
        ),
    )
    return {**record.to_json(), "record": key}


def _print(doc: dict[str, Any], deadline: float | None) -> None:
    stages: list[dict[str, Any]] = doc.get("stages") or []
    if deadline is not None:
        pids, skipped = doc.get("trainer_pids") or [], doc.get("skipped_pids") or []
        found = pids or ("none signalled" if skipped else "none found")
        print(f"drill: deadline {deadline:.0f} s, trainer pids {found}")
        print(f"  {'noticed':<22} {0:8.3f} s")
    else:
        print(f"drill (restore only): run {doc.get('run_id')}, node {doc.get('node')}")
    for stage in stages:
        name = stage["stage"]
        print(f"  {LABELS.get(name, name):<22} {_when(stage):>10}   {_detail(stage, doc)}")
        if name == "signalled" and deadline is not None and doc.get("skipped_pids"):
            print(f"  {'spared (no handler)':<22} pids {doc['skipped_pids']}")
    if deadline is not None and doc.get("safe_via"):
        # Peer replication: when the emergency checkpoint was first safe off the node, and how.
        peers = ", ".join(doc.get("safe_peers") or [])
        safe = f"{doc['safe_after_s']:8.3f} s"
        print(f"  {'safe off the node':<22} {safe:>10}   via {doc['safe_via']} {peers}".rstrip())
    if deadline is not None and doc.get("notice_published") is not None:
        # Many nodes: the other nodes' daemons follow <run>/NOTICE; the timings above are
        # this node's own emergency checkpoint.
        published = "written" if doc["notice_published"] else "NOT written"
        print(f"  {'cluster NOTICE':<22} {published} (every node's trainer saves)")
    if doc.get("result") == "success":
        print("result: passed" + ("" if deadline is None else ", committed before the deadline"))
    else:
        print(f"result: FAILED at {doc.get('failed_stage')}: {doc.get('error')}")
    if doc.get("record"):
        print(f"recorded: {doc['record']}")
    elif deadline is None:
        print("recorded: no (the store did not take the record; the result stands)")


def _when(stage: dict[str, Any]) -> str:
    if stage["status"] == "failed":
        return "FAILED"
    if stage["after_s"] is None:
        # Nothing happened: a time here would read as if it had.
        return {"skipped": "skipped", "not_reached": "-"}.get(stage["status"], "-")
    return f"{stage['after_s']:8.3f} s"


def _detail(stage: dict[str, Any], doc: dict[str, Any]) -> str:
    name, detail = stage["stage"], str(stage.get("detail") or "")
    if name == "signalled" and stage["status"] != "ok":
        return detail or "no process signalled"
    if name == "committed" and stage["status"] == "ok":
        return human_bytes(int(doc.get("bytes") or 0))
    return detail
