"""``ckptd restore``: download, verify, then appear atomically as DIR/NAME, from the first
tier whose copy verifies."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.cli.errors import EXIT_OK, UsageError
from ckptd.cli.humanize import human_bytes
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import JSON_HELP, add_common, at_least
from ckptd.runtime import logs

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers
    from ckptd.config import Settings
    from ckptd.store.tiers import TierRestore


def add_parser(sub: Subparsers) -> None:
    res = sub.add_parser("restore", help="download, verify, then appear atomically as DIR/NAME")
    add_common(res)
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
        "--if-any",
        action="store_true",
        help="with --latest: exit 0 with nothing to do when the run has nothing committed "
        "yet (a store that cannot be read still fails)",
    )
    res.add_argument(
        "--concurrency",
        type=at_least(0),  # 0 took the default before this check existed, and still does
        default=None,
        help="parallel ranged GETs (default: destination.concurrency)",
    )
    res.add_argument(
        "--part",
        type=at_least(0),
        default=None,
        metavar="NODE_RANK",
        help="many nodes: only that node's files (default: the whole checkpoint)",
    )
    res.add_argument(
        "--chunk-mib",
        type=at_least(1),
        default=16,
        help="size of each ranged GET in MiB (default %(default)s)",
    )
    res.add_argument(
        "--tier",
        default=None,
        help="only this tier (default: the first tier holding it, the next if it fails)",
    )
    res.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    res.add_argument("--json", action="store_true", help=JSON_HELP)


def handle(args: argparse.Namespace) -> int:
    from ckptd.cadence.advisor import record_restore
    from ckptd.repository import Repository
    from ckptd.storage.base import NotFoundError
    from ckptd.store.nearby import where_runs_are
    from ckptd.store.restore import RestoreRequest
    from ckptd.store.tiers import NothingCommittedError, require_roots, restore_from_tiers

    if args.if_any and not args.latest:
        raise UsageError("--if-any goes with --latest (a named checkpoint is there or not)")
    settings = settings_of(args)
    concurrency = args.concurrency or settings.destination.concurrency
    tiers = tiers_of(args, settings, concurrency=concurrency)
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
    try:
        if args.tier is None and settings.peers.enabled:
            # Peers first, and the nodes restoring it too, each verified against the
            # store's manifest; the store for the rest.
            from ckptd.peers.restore import restore_with_peers

            done, tiers = restore_with_peers(settings, tiers, request, logs.get_logger())
        else:
            done = restore_from_tiers(tiers, request)
    except NotFoundError as exc:
        # A typo'd --run or --dest reads as nothing committed: say what is there instead.
        hint = where_runs_are(tiers[0].storage, tiers[0].config, args.run_id).message
        if isinstance(exc, NothingCommittedError) and args.if_any:
            require_roots(tiers)  # a file:// root that is missing is no empty store
            if hint:  # a new run all the same; as `ckptd exec` does, said as a warning
                logs.get_logger().warning("restore_nothing_committed", run=args.run_id, hint=hint)
            return _nothing_to_do(args)
        if not hint:
            raise
        raise NotFoundError(f"{exc}; {hint}") from None
    result = done.result
    storage = next(t.storage for t in tiers if t.name == done.tier)
    record_restore(
        Repository(storage),
        result.run_id,
        result.checkpoint,
        skipped=result.skipped,
        resumes=into_watch_dir(settings, result.run_id, request.target_dir),
        now=time.time(),
    )
    if args.json:
        print_json(_document(done))
    elif result.skipped:
        print(f"present  {result.path} already holds {result.run_id}/{result.checkpoint}")
    else:
        print(
            f"restored {result.run_id}/{result.checkpoint} -> {result.path}: {result.files} files, "
            f"{human_bytes(result.total_bytes)} in {result.seconds:.1f}s"
            + (f" from tier {done.tier}" if len(tiers) > 1 else "")
            + (f" ({human_bytes(done.peer_bytes)} from peers)" if done.peer_bytes else "")
        )
    return EXIT_OK


def _nothing_to_do(args: argparse.Namespace) -> int:
    """``--if-any`` on a run with nothing committed: said on stdout, exit 0."""
    if args.json:
        print_json({"run": args.run_id, "checkpoint": None, "nothing_committed": True})
    else:
        print(f"nothing  run {args.run_id!r} has no committed checkpoint yet: nothing to restore")
    return EXIT_OK


def into_watch_dir(settings: Settings, run_id: str, to: Path) -> bool:
    """Whether ``to`` is the watch dir of ``run_id`` in ``settings``: a restore there is
    the run resuming on this node (the cadence counts it as an interruption); anywhere
    else it is a copy (``ckptd.cadence.model.restore_interruption``)."""
    return any(
        w.effective_run_id == run_id and Path(w.dir).resolve() == to.resolve()
        for w in settings.watch
    )


def _document(done: TierRestore) -> dict[str, Any]:
    result = done.result
    return {
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
        "environment_differences": {k: list(v) for k, v in result.environment_differences.items()},
        "peer_bytes": done.peer_bytes,
        "store_bytes": done.store_bytes,
    }
