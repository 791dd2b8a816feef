"""``ckptd list``: the committed checkpoints, newest last, and the tiers holding each."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptd.cli.errors import EXIT_OK
from ckptd.cli.humanize import human_bytes
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import JSON_HELP, TIER_HELP, add_common
from ckptd.runtime import logs

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers
    from ckptd.store.tiers import TieredCheckpoint, TieredListing, TierStore


def add_parser(sub: Subparsers) -> None:
    lst = sub.add_parser("list", help="committed checkpoints, newest last")
    add_common(lst)
    lst.add_argument("--run", dest="run_id", default=None, help="only this run (default: all)")
    lst.add_argument("--tier", default=None, help=TIER_HELP)
    lst.add_argument("--json", action="store_true", help=JSON_HELP)


def handle(args: argparse.Namespace) -> int:
    from ckptd.store.tiers import list_across_tiers

    tiers = tiers_of(args, settings_of(args))
    listing = list_across_tiers(tiers, args.run_id)
    for tier, error in listing.unreadable.items():  # the others are listed: say which is missing
        logs.get_logger().error("tier_unreadable", tier=tier, error=str(error))
    if args.json:
        print_json(_document(tiers, listing))
    elif not listing.checkpoints:
        where = ", ".join(t.storage.url for t in tiers)
        print(f"no committed checkpoints under {where}")
    else:
        _print_table(tiers, listing.checkpoints)
    return EXIT_OK


def _row(checkpoint: TieredCheckpoint) -> dict[str, Any]:
    m = checkpoint.manifest
    return {
        "run": checkpoint.run,
        "checkpoint": m.checkpoint,
        "name": m.local_name,
        "trajectory": m.lineage.id,
        "abandoned": checkpoint.abandoned,
        "suspect": m.suspect,
        "step": m.step,
        "total_bytes": m.total_bytes,
        "files": len(m.files),
        "layout": m.layout,
        "host": m.host,
        "committed_at": m.committed_at,
        "latest": checkpoint.latest,
        "tiers": checkpoint.tiers,
        "latest_in": checkpoint.latest_in,
    }


def _document(tiers: Sequence[TierStore], listing: TieredListing) -> dict[str, Any]:
    return {
        "destination": tiers[0].storage.url,
        "tiers": [
            {"name": t.name, "url": t.storage.url, "ok": t.name not in listing.unreadable}
            for t in tiers
        ],
        "checkpoints": [_row(c) for c in listing.checkpoints],
    }


def _print_table(tiers: Sequence[TierStore], checkpoints: Sequence[TieredCheckpoint]) -> None:
    names = [t.name for t in tiers]
    many = len(tiers) > 1
    header = f"{'RUN':<16} {'CHECKPOINT':<28} {'STEP':>8} {'SIZE':>12} {'COMMITTED':<21} STATE"
    print(header + ("  TIERS" if many else ""))
    for c in checkpoints:
        m = c.manifest
        step = "-" if m.step is None else str(m.step)
        # LATEST's; off the live trajectory (a rollback abandoned it); or neither.
        latest = "latest" if c.latest else "abandoned" if c.abandoned else ""
        # Saved after a non-finite loss (docs/health.md).
        latest = f"{latest} suspect".strip() if m.suspect else latest
        line = (
            f"{c.run:<16} {m.checkpoint:<28} {step:>8} {human_bytes(m.total_bytes):>12} "
            f"{m.committed_at:<21} {latest}"
        )
        if many:
            line = f"{line:<98}  " + ",".join(n for n in names if n in c.tiers)
        print(line.rstrip())
