"""``ckptd rm RUN[/CHECKPOINT]``: remove one checkpoint or a whole run from each tier (or
``--tier``); a dry run unless ``--yes``; what LATEST names only with ``--force``
(``ckptd.store.removal`` says the order, and where LATEST goes)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ckptd.cli.errors import EXIT_OK, UsageError
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import JSON_HELP, TIER_HELP, add_common
from ckptd.runtime import logs

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers
    from ckptd.store.removal import Removal, RemovalStep
    from ckptd.store.tiers import TierStore


def add_parser(sub: Subparsers) -> None:
    rm = sub.add_parser(
        "rm", help="remove a checkpoint or a whole run from the store (dry run unless --yes)"
    )
    add_common(rm)
    rm.add_argument("target", metavar="RUN[/CHECKPOINT]", help="a run, or one of its checkpoints")
    rm.add_argument("--tier", default=None, help=TIER_HELP)
    rm.add_argument(
        "--yes",
        action="store_true",
        help="remove (without it: a dry run, which says what would go)",
    )
    rm.add_argument(
        "--force",
        action="store_true",
        help="also what LATEST names (LATEST then moves to the newest checkpoint that stays), "
        "a checkpoint a restore is reading, or a name a writer is uploading (withdrawn: the "
        "writer is refused at its commit and keeps its local copy)",
    )
    rm.add_argument("--json", action="store_true", help=JSON_HELP)


def target_of(text: str) -> tuple[str, str | None]:
    """``RUN`` or ``RUN/CHECKPOINT`` -> (run, checkpoint or None); UsageError otherwise."""
    run, _, checkpoint = text.strip("/").partition("/")
    parts = [run, checkpoint] if checkpoint else [run]
    if not run or "/" in checkpoint or any(p.startswith(".") for p in parts):
        raise UsageError(f"RUN[/CHECKPOINT] expected, got {text!r} (ckptd list shows them)")
    return run, checkpoint or None


def handle(args: argparse.Namespace) -> int:
    from ckptd.repository import Repository
    from ckptd.storage.base import NotFoundError
    from ckptd.store.removal import apply_removal, plan_removal

    run_id, checkpoint = target_of(args.target)
    tiers = tiers_of(args, settings_of(args))
    # Every tier is planned before anything is deleted: a refusal anywhere removes nothing.
    plans: list[tuple[TierStore, Removal]] = []
    missing: list[NotFoundError] = []
    for tier in tiers:
        try:
            plans.append(
                (tier, plan_removal(Repository(tier.storage), run_id, checkpoint, force=args.force))
            )
        except NotFoundError as exc:
            missing.append(exc)
    if not plans:
        raise missing[0]
    dry = not args.yes
    log = logs.get_logger()
    for tier, removal in plans:
        if dry:
            continue

        def said(step: RemovalStep, tier: TierStore = tier) -> None:
            log.info("rm_deleted", tier=tier.name, run=run_id, kind=step.kind, name=step.name)

        apply_removal(Repository(tier.storage), removal, on_step=said)
    if args.json:
        print_json({"dry_run": dry, "tiers": [_document(t, r) for t, r in plans]})
    else:
        for tier, removal in plans:
            print(_summary(tier, removal, dry))
        if dry:
            print("dry run: nothing was removed; --yes removes it")
    return EXIT_OK


def _summary(tier: TierStore, removal: Removal, dry: bool) -> str:
    what = (
        removal.run_id if removal.checkpoint is None else f"{removal.run_id}/{removal.checkpoint}"
    )
    verb = "would remove" if dry else "removed"
    kinds = [f"{len(removal.committed)} committed checkpoint(s)"]
    if removal.uncommitted:
        kinds.append(f"{len(removal.uncommitted)} uncommitted name(s)")
    # Done: what was deleted (a withdrawal left behind is not); dry: what the plan lists.
    objects = removal.objects if dry else sum(s.objects for s in removal.steps)
    line = f"{verb} {what} from {tier.storage.url}: {', '.join(kinds)}, {objects} objects"
    if removal.moves_latest:
        moved = (
            f"LATEST {'would move' if dry else 'moved'} to {removal.run_id}/{removal.latest_after}"
            if removal.latest_after
            else f"LATEST {'would be' if dry else 'was'} removed"
        )
        line += f"; {moved}"
    if removal.uploading:
        names = ", ".join(f"{n} (by {who})" for n, who in removal.uploading.items())
        line += f"; {'would withdraw' if dry else 'withdrew'} {names} while being uploaded"
    kept = [s.name for s in removal.steps if s.kind == "kept"]
    if kept:
        line += f"; kept {', '.join(kept)}: committed meanwhile (run rm again to remove it)"
    return line


def _document(tier: TierStore, removal: Removal) -> dict[str, Any]:
    return {
        "tier": tier.name,
        "url": tier.storage.url,
        "run": removal.run_id,
        "checkpoint": removal.checkpoint,
        "committed": removal.committed,
        "uncommitted": removal.uncommitted,
        "objects": removal.objects,
        "latest": removal.latest,
        "latest_after": removal.latest_after,
        "uploading": removal.uploading,
        "steps": [{"kind": s.kind, "name": s.name, "objects": s.objects} for s in removal.steps],
    }
