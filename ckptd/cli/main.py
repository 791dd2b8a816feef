"""Command-line parsing only: every command calls into the modules that do the work.

Exit codes (docs/design.md, "CLI"): 0 success; 1 the operation failed (mismatch, daemon
unreachable, nothing committed); 2 bad usage or invalid config, with the key named.
A command returns 0 or 1 for what it checked, and raises a ``CkptdError`` for what went
wrong; ``main`` alone turns that into ``ckptd: <message>`` on stderr and the error's exit
code. ``--json`` prints one JSON document on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd import __version__
from ckptd.cli.units import human_bytes
from ckptd.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    Settings,
    load_settings,
    render_effective_config,
    require_destination,
    require_watch,
)
from ckptd.core.errors import EXIT_FAILED, EXIT_FLUSH_FAILED, EXIT_GAVE_UP, EXIT_USAGE, CkptdError
from ckptd.runtime import logs
from ckptd.runtime.yielding import lower_this_thread, priority_of
from ckptd.storage import open_destination
from ckptd.storage.base import StorageError
from ckptd.storage.retrying import RetryingStorage
from ckptd.supervision.restarts import DEFAULT_MAX_RESTARTS, RestartPolicy

if TYPE_CHECKING:
    from ckptd.store.tiers import TierStore

EXIT_OK = 0
EXIT_INTERRUPTED = 130


class UsageError(CkptdError):
    """Bad command-line usage (exit 2); ``main`` prints the usage line before it."""

    exit_code = EXIT_USAGE


class DaemonUnreachableError(CkptdError):
    """The running daemon did not answer, or answered with something other than JSON (exit 1)."""


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type for an int >= ``minimum``; anything else is bad usage (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _common(parser: argparse.ArgumentParser, log_level: str = "warning") -> None:
    """Options every command has. One-shot commands print their result on stdout and log
    only problems by default (a JSON line beside the human one said everything twice);
    the daemons (run, exec) log their work at info."""
    parser.add_argument(
        "--config", type=Path, default=None, help="TOML config (default /etc/ckptd/ckptd.toml)"
    )
    parser.add_argument(
        "--dest", default=None, help="destination URL (s3://bucket/prefix or file:///path)"
    )
    parser.add_argument(
        "--endpoint-url", default=None, help="S3-compatible endpoint, e.g. http://127.0.0.1:8333"
    )
    parser.add_argument(
        "--log-level",
        default=log_level,
        choices=["debug", "info", "warning", "error"],
        help="least severe log line written to stderr (default %(default)s)",
    )


_JSON_HELP = "one JSON document on stdout (logs stay on stderr)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptd", description="Ship every complete checkpoint off the node, verified."
    )
    parser.add_argument("-V", "--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon in the foreground")
    _common(run, log_level="info")
    run.add_argument("--watch", type=Path, default=None, help="local checkpoint dir (one run)")
    run.add_argument(
        "--run", dest="run_id", default=None, help="run id for --watch (default: its basename)"
    )
    run.add_argument("--layout", default=None, help="completion rule for --watch (default auto)")
    run.add_argument("--state-dir", type=Path, default=None, help="journal directory")
    run.add_argument(
        "--once", action="store_true", help="ship what is complete now, then exit (1 if any failed)"
    )
    run.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        help="seconds to finish the upload in flight on SIGTERM (default %(default)g)",
    )

    _add_exec(sub)

    lst = sub.add_parser("list", help="committed checkpoints, newest last")
    _common(lst)
    lst.add_argument("--run", dest="run_id", default=None, help="only this run (default: all)")
    lst.add_argument("--tier", default=None, help=_TIER_HELP)
    lst.add_argument("--json", action="store_true", help=_JSON_HELP)

    ver = sub.add_parser(
        "verify", help="re-read remote objects and check them against the manifest"
    )
    _common(ver)
    ver.add_argument("--run", dest="run_id", required=True, help="the run id")
    which = ver.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", default=None, help="the checkpoint's name")
    which.add_argument("--latest", action="store_true", help="the newest committed checkpoint")
    ver.add_argument("--tier", default=None, help=_TIER_HELP)
    ver.add_argument("--json", action="store_true", help=_JSON_HELP)

    res = sub.add_parser("restore", help="download, verify, then appear atomically as DIR/NAME")
    _common(res)
    res.add_argument("--run", dest="run_id", required=True, help="the run id")
    pick = res.add_mutually_exclusive_group(required=True)
    pick.add_argument("--checkpoint", default=None, help="the checkpoint's name")
    pick.add_argument(
        "--latest", action="store_true", help="the newest committed, verified checkpoint"
    )
    res.add_argument(
        "--to", type=Path, required=True, help="directory to restore into (as DIR/NAME)"
    )
    res.add_argument(
        "--if-missing",
        action="store_true",
        help="exit 0 at once if DIR/NAME already holds it (sizes match)",
    )
    res.add_argument(
        "--concurrency",
        type=_at_least(0),  # 0 took the default before this check existed, and still does
        default=None,
        help="parallel ranged GETs (default: destination.concurrency)",
    )
    res.add_argument(
        "--part",
        type=_at_least(0),
        default=None,
        metavar="NODE_RANK",
        help="many nodes: only that node's files (default: the whole checkpoint)",
    )
    res.add_argument(
        "--chunk-mib",
        type=_at_least(1),
        default=16,
        help="size of each ranged GET in MiB (default %(default)s)",
    )
    res.add_argument(
        "--tier",
        default=None,
        help="only this tier (default: the first tier holding it, the next if it fails)",
    )
    res.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    res.add_argument("--json", action="store_true", help=_JSON_HELP)

    status = sub.add_parser("status", help="ask the running daemon")
    _common(status)
    status.add_argument("--json", action="store_true", help=_JSON_HELP)
    status.add_argument("--url", default=None, help="daemon base URL (default from metrics.listen)")

    drill = sub.add_parser(
        "drill", help="simulated preemption against the running daemon, with timings"
    )
    _common(drill)
    drill.add_argument(
        "--deadline", type=float, default=120.0, help="seconds the simulated notice gives"
    )
    drill.add_argument("--url", default=None, help="daemon base URL (default from metrics.listen)")
    drill.add_argument("--json", action="store_true", help=_JSON_HELP)

    config = sub.add_parser("config", help="configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate and print the effective config")
    _common(check)
    return parser


EXEC_EPILOG = f"""\
Restores the run's newest committed checkpoint into the watch dir (unless a complete local
one is as new), then runs CMD with CKPTD_RESUME_FROM (the newest complete local checkpoint;
unset when none), CKPTD_RUN and CKPTD_WATCH_DIR, ships its checkpoints, and starts it again
from the newest complete checkpoint when it exits non-zero or dies by a signal.
SIGTERM, SIGINT and cloud notices make CMD save (trainer.signal), then ckptd commits that
checkpoint, stops CMD and exits.

exit codes:
  CMD's own     CMD finished by itself (0 included; with --max-restarts 0, any code)
  0             preempted, and the emergency checkpoint was committed
  {EXIT_FLUSH_FAILED}            preempted, and the emergency checkpoint was NOT committed
  {EXIT_GAVE_UP}            gave up: --max-restarts used up, or CMD failed at start-up
                {RestartPolicy.startup_attempts} times in a row, or {RestartPolicy.same_failure_attempts} times with the same cause and no new checkpoint
  1 / 2         ckptd could not start (store unreadable) / bad usage or config
"""


def _add_exec(sub: Any) -> None:
    exe = sub.add_parser(
        "exec",
        help="the daemon plus the trainer as its supervised child",
        usage="ckptd exec [options] -- CMD [ARG...]",
        epilog=EXEC_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(exe, log_level="info")
    exe.add_argument("--watch", type=Path, default=None, help="local checkpoint dir")
    exe.add_argument("--run", dest="run_id", default=None, help="run id (default: its basename)")
    exe.add_argument("--layout", default=None, help="completion rule (default auto)")
    exe.add_argument("--state-dir", type=Path, default=None, help="journal directory")
    exe.add_argument(
        "--max-restarts",
        type=_at_least(0),
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


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dest: dict[str, Any] = {}
    if getattr(args, "dest", None):
        dest["url"] = args.dest
    if getattr(args, "endpoint_url", None):
        dest["endpoint_url"] = args.endpoint_url
    if dest:
        out["destination"] = dest
    if getattr(args, "watch", None):
        watch: dict[str, Any] = {"dir": str(args.watch.expanduser().absolute())}
        if args.run_id:
            watch["run_id"] = args.run_id
        if args.layout:
            watch["layout"] = args.layout
        out["watch"] = [watch]
    elif getattr(args, "layout", None) or (
        args.command in ("run", "exec") and getattr(args, "run_id", None)
    ):
        raise UsageError("--run and --layout apply to --watch; give --watch DIR too")
    if getattr(args, "state_dir", None):
        out["state"] = {"dir": str(args.state_dir.expanduser().absolute())}
    return out


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(args.config, overrides=_overrides(args))


def _storage(settings: Settings, *, concurrency: int | None = None) -> RetryingStorage:
    require_destination(settings)
    return open_destination(
        settings.destination, concurrency=concurrency, on_retry=_retry_logger(settings)
    )


def _retry_logger(settings: Settings) -> Callable[[str, StorageError, int, float], None]:
    attempts = settings.destination.max_attempts
    log = logs.get_logger()

    def retrying(operation: str, error: StorageError, attempt: int, delay: float) -> None:
        # A dead endpoint is otherwise a silent wait: say what is retried, and for how long
        # at most (destination.max_attempts bounds it).
        log.warning(
            "store_retry",
            operation=operation,
            error=str(error),
            code=error.code,
            attempt=f"{attempt}/{attempts}",
            retry_in=round(delay, 2),
        )

    return retrying


_TIER_HELP = "only this tier (a [destination] or [[tiers]] name; default: every tier)"


def _tiers(
    args: argparse.Namespace, settings: Settings, *, concurrency: int | None = None
) -> list[TierStore]:
    """The destinations a read command uses, in preference order: every configured tier,
    or only ``--dest`` when given (a URL on the command line names one store)."""
    from ckptd.store.tiers import open_tiers

    require_destination(settings)
    if getattr(args, "dest", None):
        settings = settings.model_copy(update={"tiers": []})
    tier = getattr(args, "tier", None)
    return open_tiers(
        settings, only=tier, concurrency=concurrency, on_retry=_retry_logger(settings)
    )


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def cmd_run(args: argparse.Namespace) -> int:
    from ckptd.daemon.service import Service

    settings = _settings(args)
    require_destination(settings)
    require_watch(settings)
    # First, while this is the only thread: every thread the daemon starts inherits it.
    # (ckptd exec does not: its trainer would inherit it too; its workers lower themselves.)
    for problem in lower_this_thread(priority_of(settings.resources)):
        logs.get_logger().warning("priority_not_lowered", problem=problem)
    return asyncio.run(
        Service(settings, once=args.once, shutdown_timeout=args.shutdown_timeout).serve()
    )


def cmd_exec(args: argparse.Namespace) -> int:
    from ckptd.supervision.exec_service import SupervisedService

    command = list(args.trainer_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("no trainer command: ckptd exec [options] -- CMD [ARG...]")
    settings = _settings(args)
    require_destination(settings)
    require_watch(settings)
    if len(settings.watch) != 1:
        raise ConfigError(
            "watch",
            f"ckptd exec supervises one trainer and needs exactly one [[watch]], "
            f"not {len(settings.watch)}; keep one, or give --watch DIR",
        )
    policy = RestartPolicy(max_restarts=args.max_restarts)
    service = SupervisedService(
        settings, command, policy=policy, shutdown_timeout=args.shutdown_timeout
    )
    return asyncio.run(service.serve())


def cmd_list(args: argparse.Namespace) -> int:
    from ckptd.store.tiers import list_runs, list_tiers

    tiers = _tiers(args, _settings(args))
    names = [t.name for t in tiers]
    runs, errors = ([args.run_id], {}) if args.run_id else list_runs(tiers)
    if len(errors) == len(tiers):
        raise next(iter(errors.values()))  # nothing could be read at all
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for run_id in runs:
        for listing in list_tiers(tiers, run_id):
            if listing.error is not None:
                errors.setdefault(listing.tier, listing.error)
            for c in listing.committed:
                m = c.manifest
                row = rows.setdefault(
                    (run_id, m.checkpoint),
                    {
                        "run": run_id,
                        "checkpoint": m.checkpoint,
                        "step": m.step,
                        "total_bytes": m.total_bytes,
                        "files": len(m.files),
                        "layout": m.layout,
                        "host": m.host,
                        "committed_at": m.committed_at,
                        "latest": False,
                        "tiers": [],
                        "latest_in": [],
                    },
                )
                row["tiers"].append(listing.tier)
                if c.is_latest:
                    row["latest_in"].append(listing.tier)
                    # `latest` (one destination's contract) is the first tier's LATEST.
                    row["latest"] = row["latest"] or listing.tier == names[0]
    ordered = sorted(
        rows.values(),
        key=lambda r: (r["run"], r["step"] if r["step"] is not None else -1, r["committed_at"]),
    )
    if len(errors) == len(tiers):
        raise next(iter(errors.values()))
    for tier, error in errors.items():  # the others are listed: say which is missing
        logs.get_logger().error("tier_unreadable", tier=tier, error=str(error))
    if args.json:
        _print_json(
            {
                "destination": tiers[0].storage.url,
                "tiers": [
                    {"name": t.name, "url": t.storage.url, "ok": t.name not in errors}
                    for t in tiers
                ],
                "checkpoints": ordered,
            }
        )
        return EXIT_OK
    if not ordered:
        where = ", ".join(t.storage.url for t in tiers)
        print(f"no committed checkpoints under {where}")
        return EXIT_OK
    many = len(tiers) > 1
    header = f"{'RUN':<16} {'CHECKPOINT':<28} {'STEP':>8} {'SIZE':>12} {'COMMITTED':<21} LATEST"
    print(header + ("  TIERS" if many else ""))
    for r in ordered:
        step = "-" if r["step"] is None else str(r["step"])
        latest = "*" if r["latest"] else ""
        line = (
            f"{r['run']:<16} {r['checkpoint']:<28} {step:>8} {human_bytes(r['total_bytes']):>12} "
            f"{r['committed_at']:<21} {latest}"
        )
        if many:
            line = f"{line:<98}  " + ",".join(n for n in names if n in r["tiers"])
        print(line.rstrip())
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptd.storage.base import NotFoundError
    from ckptd.store.repository import Repository
    from ckptd.store.verify import verify_checkpoint

    settings = _settings(args)
    tiers = _tiers(args, settings)
    keys = settings.authentication.key_ring()
    many = len(tiers) > 1
    reports: list[dict[str, Any]] = []
    bad = False
    for tier in tiers:
        try:
            manifest = Repository(tier.storage).resolve(
                args.run_id, None if args.latest else args.checkpoint
            )
        except NotFoundError:
            if not many:
                raise
            # A pinned checkpoint one tier never held (or has aged out) is no mismatch.
            reports.append({"tier": tier.name, "held": False})
            continue
        problems = verify_checkpoint(
            tier.storage, manifest, concurrency=tier.config.concurrency, keys=keys
        )
        bad = bad or bool(problems)
        reports.append(
            {
                "tier": tier.name,
                "held": True,
                "run": manifest.run_id,
                "checkpoint": manifest.checkpoint,
                "ok": not problems,
                "files": len(manifest.files),
                "total_bytes": manifest.total_bytes,
                "problems": [{"path": p.path, "problem": p.problem} for p in problems],
            }
        )
    held = [r for r in reports if r["held"]]
    if not held:
        raise NotFoundError(f"{args.run_id}/{args.checkpoint} is not committed in any tier")
    if args.json:
        if many:
            _print_json({"ok": not bad, "tiers": reports})
        else:
            doc = dict(held[0])
            doc.pop("tier"), doc.pop("held"), doc.pop("total_bytes")
            _print_json(doc)
        return EXIT_FAILED if bad else EXIT_OK
    for r in reports:
        where = f"[{r['tier']}] " if many else ""
        if not r["held"]:
            print(f"--   {where}{args.run_id}/{args.checkpoint}: not in this tier")
            continue
        name = f"{r['run']}/{r['checkpoint']}"
        for p in r["problems"]:
            print(f"BAD  {where}{name}/{p['path']}: {p['problem']}")
        if r["problems"]:
            print(f"{where}{len(r['problems'])} of {r['files']} files do not match the manifest")
        else:
            print(f"OK   {where}{name}: {r['files']} files, {human_bytes(r['total_bytes'])}")
    return EXIT_FAILED if bad else EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    from ckptd.store.restore import RestoreRequest
    from ckptd.store.tiers import restore_from_tiers

    settings = _settings(args)
    concurrency = args.concurrency or settings.destination.concurrency
    tiers = _tiers(args, settings, concurrency=concurrency)
    request = RestoreRequest(
        args.run_id,
        None if args.latest else args.checkpoint,
        args.to.expanduser().absolute(),
        if_missing=args.if_missing,
        concurrency=concurrency,
        chunk_bytes=args.chunk_mib * 1024 * 1024,
        progress=False if args.no_progress else None,
        part=args.part,
        keys=settings.authentication.key_ring(),
    )
    done = restore_from_tiers(tiers, request)
    result = done.result
    storage = next(t.storage for t in tiers if t.name == done.tier)
    if not result.skipped:
        import time

        from ckptd.cadence.advisor import record_restore
        from ckptd.store.repository import Repository

        # A restore is how a fresh node resumes a run: one of its interruptions.
        record_restore(Repository(storage), result.run_id, time.time(), result.checkpoint)
    if args.json:
        _print_json(
            {
                "run": result.run_id,
                "checkpoint": result.checkpoint,
                "step": result.step,
                "path": str(result.path),
                "files": result.files,
                "total_bytes": result.total_bytes,
                "downloaded_bytes": result.downloaded_bytes,
                "reused_bytes": result.reused_bytes,
                "seconds": round(result.seconds, 3),
                "skipped": result.skipped,
                "tier": done.tier,
                "skipped_tiers": list(done.skipped_tiers),
                "environment_differences": {
                    k: list(v) for k, v in result.environment_differences.items()
                },
            }
        )
    elif result.skipped:
        print(f"present  {result.path} already holds {result.run_id}/{result.checkpoint}")
    else:
        print(
            f"restored {result.run_id}/{result.checkpoint} -> {result.path}: {result.files} files, "
            f"{human_bytes(result.total_bytes)} in {result.seconds:.1f}s"
            + (f" from tier {done.tier}" if len(tiers) > 1 else "")
        )
    return EXIT_OK


def _daemon_request(
    args: argparse.Namespace,
    path: str,
    *,
    failure: str,
    method: str = "GET",
    timeout: float = 5,
) -> tuple[str, Any]:
    """The daemon's base URL and its JSON answer; DaemonUnreachableError ("<failure>: why")
    when it does not answer, refuses, or answers with something other than JSON."""
    settings = _settings(args)
    base = args.url or f"http://{_url_host(settings.metrics.host)}:{settings.metrics.port}"
    try:
        request = urllib.request.Request(f"{base}{path}", method=method)
        token = settings.http.token.get_secret_value()
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return base, json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DaemonUnreachableError(f"{failure}: {exc}") from exc


def cmd_drill(args: argparse.Namespace) -> int:
    _, doc = _daemon_request(
        args,
        f"/v1/drill?deadline={args.deadline}",
        failure="drill failed: daemon not reachable or refused",
        method="POST",
        timeout=args.deadline + 30,
    )
    ok = bool(doc.get("committed_before_deadline"))
    if args.json:
        _print_json(doc)
        return EXIT_OK if ok else EXIT_FAILED

    def at(key: str) -> str:
        value = doc.get(key)
        return "-" if value is None else f"{value:8.3f} s"

    print(
        f"drill: deadline {args.deadline:.0f} s, trainer pids {doc.get('trainer_pids') or 'none found'}"
    )
    print(f"  {'noticed':<22} {0:8.3f} s")
    print(f"  {'trainer signalled':<22} {at('signalled_after_s')}")
    print(f"  {'checkpoint complete':<22} {at('complete_after_s')}   {doc.get('checkpoint') or ''}")
    print(
        f"  {'committed':<22} {at('committed_after_s')}   {human_bytes(int(doc.get('bytes') or 0))}"
    )
    if doc.get("notice_published") is not None:
        # Many nodes: the other nodes' daemons follow <run>/NOTICE; the timings above are
        # this node's own emergency checkpoint.
        published = "written" if doc["notice_published"] else "NOT written"
        print(f"  {'cluster NOTICE':<22} {published} (every node's trainer saves)")
    print(
        "result: "
        + ("committed before the deadline" if ok else "NOT committed before the deadline")
    )
    return EXIT_OK if ok else EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    _base, doc = _daemon_request(args, "/v1/status", failure="daemon not reachable")
    if args.json:
        _print_json(doc)
        return EXIT_OK
    from rich.console import Console

    from ckptd.cli.statusview import render_status

    render_status(doc, Console())
    return EXIT_OK


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def cmd_config(args: argparse.Namespace) -> int:
    if args.config is None and not DEFAULT_CONFIG_PATH.exists():
        sys.stderr.write(
            f"ckptd: note: no config file ({DEFAULT_CONFIG_PATH} does not exist, no --config): "
            "defaults and CKPTD_* variables only\n"
        )
    settings = _settings(args)
    sys.stdout.write(render_effective_config(settings))
    # Valid is what `ckptd run` accepts: the same settings must not pass here and fail there.
    require_destination(settings)
    require_watch(settings)
    return EXIT_OK


COMMANDS = {
    "run": cmd_run,
    "exec": cmd_exec,
    "list": cmd_list,
    "verify": cmd_verify,
    "restore": cmd_restore,
    "status": cmd_status,
    "drill": cmd_drill,
    "config": cmd_config,
}


def error_lines(exc: CkptdError, command: str) -> list[str]:
    """What stderr shows for ``exc`` raised by ``command``: the first line goes after
    "ckptd: ", the rest (a restore's files at fault) as they are."""
    if isinstance(exc, UsageError):
        return [f"error: {exc}"]  # argparse's own wording, after the usage line
    if command == "restore":
        from ckptd.core.manifest import ManifestError
        from ckptd.store.restore import RestoreError  # loaded already: cmd_restore imported it

        if isinstance(exc, RestoreError):
            return [f"restore failed: {exc}", *(f"  {p.path}: {p.problem}" for p in exc.problems)]
        if isinstance(exc, ManifestError):
            return [f"restore refused: {exc}"]
    if command == "verify":
        from ckptd.core.signing import AuthenticationError

        if isinstance(exc, AuthenticationError):
            return [f"verify refused: {exc}"]
    return [str(exc)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every exit code but a command's own 0/1 result is decided here."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on bad usage
    logs.configure(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except CkptdError as exc:
        if isinstance(exc, UsageError):
            parser.print_usage(sys.stderr)
        first, *details = error_lines(exc, args.command)
        print(f"ckptd: {first}", file=sys.stderr)
        for line in details:
            print(line, file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
