"""``ckptd prune``: remote retention as configured, applied by hand to each tier's runs;
dry unless asked to act.

It is the daemon's own pass (``ckptd.store.retention.apply_retention``): the same rules,
the same reads, the same order of deletes (each committed checkpoint's manifest first,
then its objects; then orphans, leftovers of many-node saves that can never commit, stale
restore leases). Each tier keeps by its own policy: ``[retention]`` for
``[destination]``, ``[tiers.retention]`` for a tier. What the pass protects is what any
node's pass protects from another node's uploads: what LATEST names, what a fresh
restore lease holds, and every uncommitted name at or above the step floor of the
orphan rule (an upload in flight is newer than what is committed). The CLI knows of no
upload in flight itself, so it protects no name beyond those.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptd.commit.parts import ABANDON_GRACE_SECONDS
from ckptd.config import Settings, TierConfig, TierRetentionConfig
from ckptd.repository import Repository
from ckptd.store.retention import RetentionAction, apply_retention
from ckptd.store.tiers import TierStore


@dataclass
class TierPrune:
    """What one tier's prune did (or, dry, would do), in the order of its deletes."""

    tier: str
    url: str
    policy: TierRetentionConfig
    runs: list[str]
    actions: list[RetentionAction] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Actions by kind (``checkpoint``, ``orphan``, ``cluster``, ``lease``)."""
        found = {"checkpoint": 0, "orphan": 0, "cluster": 0, "lease": 0}
        for action in self.actions:
            found[action.kind] += 1
        return found


def policy_of(settings: Settings, tier: TierStore) -> TierRetentionConfig:
    """The retention a tier is kept by: its ``[tiers.retention]``, or ``[retention]``."""
    if isinstance(tier.config, TierConfig):
        return tier.config.retention
    return settings.retention


def prune_tier(
    tier: TierStore,
    policy: TierRetentionConfig,
    run_id: str | None = None,
    *,
    dry_run: bool,
    now: float | None = None,
    on_action: Callable[[RetentionAction], None] | None = None,
) -> TierPrune:
    """Apply ``policy`` to ``run_id`` (None: every run the tier holds), run by run."""
    repo = Repository(tier.storage)
    runs: Sequence[str] = [run_id] if run_id is not None else repo.list_runs()
    done = TierPrune(tier.name, tier.storage.url, policy, list(runs))

    def heard(action: RetentionAction) -> None:
        done.actions.append(action)
        if on_action is not None:
            on_action(action)

    for run in runs:
        apply_retention(
            repo,
            run,
            keep_last=policy.keep_last,
            keep_every_steps=policy.keep_every_steps,
            keep_within=policy.keep_within_seconds,
            now=time.time() if now is None else now,
            # Leftovers of a many-node save that can never commit; a run of one node
            # has none, so this costs it nothing.
            cluster_grace_seconds=ABANDON_GRACE_SECONDS,
            dry_run=dry_run,
            on_action=heard,
        )
    return done


__all__ = ["TierPrune", "policy_of", "prune_tier"]
