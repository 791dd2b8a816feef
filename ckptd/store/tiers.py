"""Reading several destinations (tiers): which holds what, and restore from the best one.

Each tier is committed on its own (its own manifests and LATEST), so a checkpoint is in
a tier exactly when that tier holds its manifest. The order of the tiers in the
configuration (``[destination]``, then each ``[[tiers]]``) is the order of preference:
the fastest first.

``restore_from_tiers`` with no checkpoint named takes the newest step committed in any
tier that can be read, then tries the tiers that hold it, in order. A tier whose copy
fails verification (an object missing, of the wrong size or CRC-32C), whose manifest
does not parse, or which cannot be reached, is passed over for the next with one log
line (``restore_tier_skipped``); ``restore`` itself guarantees that a failed attempt
leaves nothing under ``DIR/NAME``. A problem that is not the tier's (``DIR/NAME``
exists, a local I/O error) ends the restore at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ckptd.config import ConfigError, DestinationConfig, Settings
from ckptd.core.manifest import Manifest, ManifestError
from ckptd.storage import open_destination
from ckptd.storage.base import NotFoundError, Storage, StorageError
from ckptd.storage.retrying import RetryHook
from ckptd.store.repository import CommittedCheckpoint, Repository
from ckptd.store.restore import RestoreError, RestoreRequest, RestoreResult, restore


@dataclass(frozen=True)
class TierStore:
    """One configured destination, opened for reading."""

    name: str
    storage: Storage
    config: DestinationConfig


def tier_configs(settings: Settings) -> list[DestinationConfig]:
    """Every destination in preference order: ``[destination]``, then ``[[tiers]]``."""
    return [settings.destination, *settings.tiers]


def open_tiers(
    settings: Settings,
    *,
    only: str | None = None,
    concurrency: int | None = None,
    on_retry: RetryHook | None = None,
) -> list[TierStore]:
    """The tiers opened for reading (``only``: that one; ConfigError ``--tier`` naming
    the known ones when there is no such tier)."""
    configs = tier_configs(settings)
    if only is not None:
        chosen = [c for c in configs if c.name == only]
        if not chosen:
            known = ", ".join(repr(c.name) for c in configs)
            raise ConfigError("--tier", f"no tier named {only!r}; the tiers are {known}")
        configs = chosen
    return [
        TierStore(
            c.name,
            open_destination(c, concurrency=concurrency, on_retry=on_retry),
            c,
        )
        for c in configs
    ]


@dataclass
class TierListing:
    """What one tier holds of a run, or why it could not be read."""

    tier: str
    committed: list[CommittedCheckpoint]
    error: StorageError | None = None


def list_tiers(tiers: Sequence[TierStore], run_id: str) -> list[TierListing]:
    """Each tier's committed checkpoints of ``run_id`` (read in parallel); a tier that
    cannot be read is reported with its error, never fatal."""

    def one(tier: TierStore) -> TierListing:
        try:
            return TierListing(tier.name, Repository(tier.storage).list_committed(run_id))
        except StorageError as exc:
            return TierListing(tier.name, [], exc)

    with ThreadPoolExecutor(max_workers=max(1, len(tiers))) as pool:
        return list(pool.map(one, tiers))


def list_runs(tiers: Sequence[TierStore]) -> tuple[list[str], dict[str, StorageError]]:
    """Every run any tier holds (sorted), and the tiers that could not be listed."""
    runs: set[str] = set()
    errors: dict[str, StorageError] = {}
    for tier in tiers:
        try:
            runs.update(Repository(tier.storage).list_runs())
        except StorageError as exc:
            errors[tier.name] = exc
    return sorted(runs), errors


@dataclass(frozen=True)
class TierRestore:
    """A restore over tiers: the result, and the tier it came from."""

    result: RestoreResult
    tier: str
    skipped_tiers: tuple[str, ...] = ()


def _step_key(manifest: Manifest) -> int:
    return manifest.step if manifest.step is not None else -1


def newest_in_tiers(
    tiers: Sequence[TierStore], run_id: str, log: Any
) -> tuple[Manifest, list[TierStore]]:
    """The manifest of the newest checkpoint committed in any tier, and the tiers holding
    it (in order). NotFoundError when no tier holds one; when none holds one but some
    could not be read, that tier's error (it may hold the run's history)."""
    found: list[tuple[TierStore, Manifest]] = []
    error: StorageError | ManifestError | None = None
    for tier in tiers:
        try:
            found.append((tier, Repository(tier.storage).resolve(run_id, None)))
        except NotFoundError:
            continue
        except (StorageError, ManifestError) as exc:
            log.warning("restore_tier_unreadable", tier=tier.name, error=str(exc))
            error = error or exc
    if not found:
        if error is not None:
            raise error
        raise NotFoundError(f"run {run_id!r} has no committed checkpoint in any tier")
    # max() keeps the first of equals: the earliest tier wins a tie of steps.
    _, best = max(found, key=lambda pair: _step_key(pair[1]))
    holders = [t for t, m in found if m.checkpoint == best.checkpoint]
    # A tier whose LATEST is older may still hold this checkpoint (a later one of its own
    # deleted, say); it is a fallback all the same, in its place in the order.
    for tier in tiers:
        if tier in holders or tier not in [t for t, _ in found]:
            continue
        try:
            if Repository(tier.storage).has_manifest(run_id, best.checkpoint):
                holders.append(tier)
        except StorageError:
            continue
    holders.sort(key=list(tiers).index)
    return best, holders


def restore_from_tiers(tiers: Sequence[TierStore], request: RestoreRequest) -> TierRestore:
    """Restore ``request``'s checkpoint (None: the newest in any tier) from the first tier
    that holds it and whose copy verifies (module doc). The last tier's error is raised
    when none does."""
    from ckptd.runtime import logs

    run_id, checkpoint = request.run_id, request.checkpoint
    log = logs.get_logger(run=run_id)
    if checkpoint is None:
        newest, holders = newest_in_tiers(tiers, run_id, log)
        name = newest.checkpoint
    else:
        name, holders = checkpoint, list(tiers)
    skipped: list[str] = []
    last: Exception | None = None
    for index, tier in enumerate(holders):
        try:
            result = restore(tier.storage, replace(request, checkpoint=name))
            return TierRestore(result, tier.name, tuple(skipped))
        except RestoreError as exc:
            if not exc.problems or os.path.lexists(request.target_dir / name):
                raise  # not the tier's fault: the target, a local I/O error
            last = exc
        except NotFoundError as exc:
            last = exc
            if checkpoint is not None and len(holders) > 1:
                continue  # a tier that never held the named checkpoint: nothing to say
        except (StorageError, ManifestError) as exc:
            last = exc
        if len(holders) == 1:
            raise last
        skipped.append(tier.name)
        following = holders[index + 1].name if index + 1 < len(holders) else None
        log.warning(
            "restore_tier_skipped",
            tier=tier.name,
            checkpoint=name,
            error=str(last),
            next_tier=following,
        )
    assert last is not None
    if isinstance(last, NotFoundError) and checkpoint is not None:
        raise NotFoundError(f"{run_id}/{checkpoint} is not committed in any tier") from last
    raise last


__all__ = [
    "TierListing",
    "TierRestore",
    "TierStore",
    "list_runs",
    "list_tiers",
    "newest_in_tiers",
    "open_tiers",
    "restore_from_tiers",
    "tier_configs",
]
