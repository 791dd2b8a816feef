"""``ckptd check --watch DIR``: the watch dir's checkpoints against the store's committed
ones, as ``rclone check`` compares two trees (``ckptd.store.local_check``); exit 1 when a
checkpoint differs or is here and not committed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.cli.errors import EXIT_OK, UsageError
from ckptd.cli.humanize import human_bytes
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import JSON_HELP, add_common
from ckptd.core.errors import EXIT_FAILED

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers
    from ckptd.store.local_check import CheckpointComparison

# What each state reads as, first on its line.
LABEL = {
    "identical": "OK",
    "differs": "DIFFERS",
    "pruned": "PRUNED",
    "only-local": "LOCAL",
    "only-in-store": "STORE",
}
# The states that make the exit code 1.
DIFFERENCES = ("differs", "only-local")


def add_parser(sub: Subparsers) -> None:
    chk = sub.add_parser(
        "check", help="local checkpoints against the store: identical, differing, or on one side"
    )
    add_common(chk)
    chk.add_argument(
        "--watch", type=Path, default=None, help="the local checkpoint dir (default: [[watch]])"
    )
    chk.add_argument(
        "--run", dest="run_id", default=None, help="the run id (default: --watch's basename)"
    )
    chk.add_argument(
        "--tier", default=None, help="against this tier (default: the first, [destination])"
    )
    chk.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the daemon's state dir, whose journal tells a checkpoint retention removed "
        "from one never shipped (default: state.dir)",
    )
    chk.add_argument("--json", action="store_true", help=JSON_HELP)


def handle(args: argparse.Namespace) -> int:
    from ckptd.config import TierConfig
    from ckptd.repository import Repository
    from ckptd.store.local_check import committed_here, compare_run

    settings = settings_of(args)
    watches = [
        w
        for w in settings.watch
        if args.watch or not args.run_id or w.effective_run_id == args.run_id
    ]
    if not watches:
        raise UsageError("give --watch DIR (or a [[watch]] in the config, or its --run)")
    tier = tiers_of(args, settings)[0]
    repo = Repository(tier.storage)
    # This node's journal for that tier, as the daemon keeps it (``ckptd.daemon.build``).
    journal_dir = Path(settings.state.dir)
    if isinstance(tier.config, TierConfig):
        journal_dir = journal_dir / "tiers" / tier.name
    runs = [
        (
            w.effective_run_id,
            Path(w.dir),
            compare_run(
                repo,
                w.effective_run_id,
                Path(w.dir),
                concurrency=tier.config.concurrency,
                committed=committed_here(journal_dir, w.effective_run_id),
            ),
        )
        for w in watches
    ]
    counts = {state: 0 for state in LABEL}
    for _, _, found in runs:
        for c in found:
            counts[c.state] += 1
    ok = not any(counts[state] for state in DIFFERENCES)
    if args.json:
        print_json(
            {
                "destination": tier.storage.url,
                "ok": ok,
                "counts": counts,
                "runs": [
                    {"run": run, "watch": str(where), "checkpoints": [_row(c) for c in found]}
                    for run, where, found in runs
                ],
            }
        )
    else:
        for run, _, found in runs:
            for c in found:
                print(_line(run, c, tier.storage.url))
        print(
            f"{counts['identical']} identical, {counts['differs']} differ, "
            f"{counts['pruned']} pruned by retention, {counts['only-local']} only here, "
            f"{counts['only-in-store']} only in the store"
        )
    return EXIT_OK if ok else EXIT_FAILED


def _line(run: str, c: CheckpointComparison, url: str) -> str:
    head = f"{LABEL[c.state]:<8} {run}/{c.name}"
    if c.state == "identical":
        return (
            f"{head}: committed, byte-identical ({c.files} files, "
            f"{human_bytes(c.total_bytes)}: each file's CRC-32C here against the manifest, "
            "each object listed in the store with its size)"
        )
    if c.state == "pruned":
        return f"{head}: committed from here, then removed from {url} by retention"
    if c.state == "only-local":
        return f"{head}: here, not committed in {url}"
    if c.state == "only-in-store":
        return f"{head}: committed, not here"
    shown = "; ".join(f"{p.path or '.'}: {p.problem}" for p in c.problems)
    return f"{head}: {len(c.problems)} file(s) differ from the committed copy: {shown}"


def _row(c: CheckpointComparison) -> dict[str, Any]:
    return {
        "checkpoint": c.name,
        "state": c.state,
        "files": c.files,
        "total_bytes": c.total_bytes,
        "problems": [{"path": p.path, "problem": p.problem} for p in c.problems],
    }
