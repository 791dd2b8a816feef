"""``ckptd verify``: re-read a committed checkpoint's objects in each tier and check them
against its manifest (exit 1 on any mismatch)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptd.cli.errors import EXIT_OK
from ckptd.cli.humanize import human_bytes
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import JSON_HELP, TIER_HELP, add_common
from ckptd.core.errors import EXIT_FAILED

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers
    from ckptd.store.tiers import TierVerification


def add_parser(sub: Subparsers) -> None:
    ver = sub.add_parser(
        "verify", help="re-read remote objects and check them against the manifest"
    )
    add_common(ver)
    ver.add_argument("--run", dest="run_id", required=True, help="the run id")
    which = ver.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", default=None, help="the checkpoint's name")
    which.add_argument("--latest", action="store_true", help="the newest committed checkpoint")
    ver.add_argument("--tier", default=None, help=TIER_HELP)
    ver.add_argument("--json", action="store_true", help=JSON_HELP)


def handle(args: argparse.Namespace) -> int:
    from ckptd.store.tiers import verify_across_tiers

    settings = settings_of(args)
    tiers = tiers_of(args, settings)
    results = verify_across_tiers(
        tiers,
        args.run_id,
        None if args.latest else args.checkpoint,
        keys=settings.authentication.key_ring(),
    )
    many = len(tiers) > 1
    reports = [_report(r) for r in results]
    bad = any(r.problems for r in results)
    if args.json:
        if many:
            print_json({"ok": not bad, "tiers": reports})
        else:
            doc = dict(next(r for r in reports if r["held"]))
            doc.pop("tier"), doc.pop("held"), doc.pop("total_bytes")
            print_json(doc)
    else:
        _print_reports(args, reports, many)
    return EXIT_FAILED if bad else EXIT_OK


def _report(result: TierVerification) -> dict[str, Any]:
    manifest = result.manifest
    if manifest is None:
        return {"tier": result.tier, "held": False}
    return {
        "tier": result.tier,
        "held": True,
        "run": manifest.run_id,
        "checkpoint": manifest.checkpoint,
        "ok": not result.problems,
        "files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
        "problems": [{"path": p.path, "problem": p.problem} for p in result.problems],
    }


def _print_reports(args: argparse.Namespace, reports: Sequence[dict[str, Any]], many: bool) -> None:
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
