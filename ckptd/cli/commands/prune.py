"""``ckptd prune``: remote retention as configured, by hand, on every run of each tier (or
``--run``, ``--tier``); a dry run unless ``--yes`` (``ckptd.store.pruning``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ckptd.cli.errors import EXIT_OK
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import JSON_HELP, TIER_HELP, add_common

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers
    from ckptd.store.pruning import TierPrune
    from ckptd.store.retention import RetentionAction

YES_HELP = "delete (without it: a dry run, which says what would be deleted)"
# How each kind of deletion reads on a line of its own.
WHAT = {
    "checkpoint": "checkpoint (manifest first)",
    "orphan": "orphan (objects, no manifest)",
    "cluster": "announcement and parts of a save that can never commit",
    "lease": "stale restore lease",
}


def add_parser(sub: Subparsers) -> None:
    pr = sub.add_parser(
        "prune", help="apply the configured retention to the store now (dry run unless --yes)"
    )
    add_common(pr)
    pr.add_argument("--run", dest="run_id", default=None, help="only this run (default: all)")
    pr.add_argument("--tier", default=None, help=TIER_HELP)
    pr.add_argument("--yes", action="store_true", help=YES_HELP)
    pr.add_argument("--json", action="store_true", help=JSON_HELP)


def handle(args: argparse.Namespace) -> int:
    from ckptd.store.pruning import policy_of, prune_tier

    settings = settings_of(args)
    dry = not args.yes

    def said(action: RetentionAction) -> None:
        # Each deletion as it is made, on stdout (the executor also logs those made).
        if not args.json:
            verb = "would delete" if dry else "deleted"
            print(
                f"{verb:<13}{action.run_id}/{action.name}: {WHAT[action.kind]}, "
                f"{action.objects} object{'s' if action.objects != 1 else ''}"
            )

    done = [
        prune_tier(tier, policy_of(settings, tier), args.run_id, dry_run=dry, on_action=said)
        for tier in tiers_of(args, settings)
    ]
    if args.json:
        print_json({"dry_run": dry, "tiers": [_document(t) for t in done]})
    else:
        for tier in done:
            print(_summary(tier, dry, many=len(done) > 1))
    return EXIT_OK


def _policy(tier: TierPrune) -> str:
    p = tier.policy
    return (
        f"keep_last={p.keep_last} keep_every_steps={p.keep_every_steps} keep_within={p.keep_within}"
    )


def _summary(tier: TierPrune, dry: bool, *, many: bool) -> str:
    counts = tier.counts()
    parts = [
        f"{counts['checkpoint']} checkpoint(s)",
        f"{counts['orphan']} orphan(s)",
        f"{counts['cluster']} unfinished many-node save(s)",
        f"{counts['lease']} stale lease(s)",
    ]
    runs = f"{len(tier.runs)} run{'s' if len(tier.runs) != 1 else ''}"
    where = f"[{tier.tier}] " if many else ""
    if dry:
        return (
            f"{where}dry run on {tier.url} ({runs}, {_policy(tier)}): would delete "
            f"{', '.join(parts)}; --yes deletes"
        )
    return f"{where}pruned {tier.url} ({runs}, {_policy(tier)}): deleted {', '.join(parts)}"


def _document(tier: TierPrune) -> dict[str, Any]:
    return {
        "tier": tier.tier,
        "url": tier.url,
        "policy": {
            "keep_last": tier.policy.keep_last,
            "keep_every_steps": tier.policy.keep_every_steps,
            "keep_within": tier.policy.keep_within,
        },
        "runs": tier.runs,
        "actions": [
            {"kind": a.kind, "run": a.run_id, "name": a.name, "objects": a.objects}
            for a in tier.actions
        ],
        "counts": tier.counts(),
    }
