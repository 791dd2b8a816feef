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

``list_across_tiers`` merges the tiers' listings into one row per checkpoint, naming the
tiers that hold it; ``verify_across_tiers`` verifies a checkpoint in every tier that holds
it. Both pass over a tier that cannot be read, and fail only when none can.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ckptd.commit.lineage import abandoned
from ckptd.config import ConfigError, DestinationConfig, Settings
from ckptd.core.manifest import Manifest, ManifestError
from ckptd.core.signing import KeyRing
from ckptd.repository import CommittedCheckpoint, FileProblem, Repository
from ckptd.storage import open_destination
from ckptd.storage.base import NotFoundError, Storage, StorageError
from ckptd.storage.retrying import RetryHook
from ckptd.store.restore import RestoreError, RestoreRequest, RestoreResult, restore
from ckptd.store.verify import verify_checkpoint


def _step_key(manifest: Manifest) -> int:
    return manifest.step if manifest.step is not None else -1


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


@dataclass
class TieredCheckpoint:
    """One committed checkpoint as the tiers hold it (``list_across_tiers``)."""

    run: str
    manifest: Manifest  # as the first tier holding it has it
    tiers: list[str]  # the tiers holding it, in preference order
    latest_in: list[str]  # the tiers whose LATEST names it
    # One destination's contract: the first tier's LATEST, whatever the others say.
    latest: bool = False
    # Off the live trajectory's lineage in the first tier holding it
    # (``ckptd.commit.lineage.abandoned``): restorable by its slot, removed first.
    abandoned: bool = False


@dataclass
class TieredListing:
    """Every committed checkpoint of the runs listed, oldest first, and the tiers that
    could not be read (the others were listed)."""

    checkpoints: list[TieredCheckpoint]
    unreadable: dict[str, StorageError]


def list_across_tiers(tiers: Sequence[TierStore], run_id: str | None = None) -> TieredListing:
    """The committed checkpoints of ``run_id`` (None: of every run any tier holds), one
    entry per checkpoint naming the tiers that hold it, sorted by run, step, then commit
    time. Raises the first tier's error only when no tier could be read at all."""
    first = tiers[0].name
    runs, errors = ([run_id], {}) if run_id else list_runs(tiers)
    if len(errors) == len(tiers):
        raise next(iter(errors.values()))  # nothing could be read at all
    merged: dict[tuple[str, str], TieredCheckpoint] = {}
    off_line: set[tuple[str, str]] = set()
    for run in runs:
        judged = False
        for listing in list_tiers(tiers, run):
            if listing.error is not None:
                errors.setdefault(listing.tier, listing.error)
            if listing.committed and not judged:  # the first readable tier's lineage
                judged = True
                latest = next(
                    (c.manifest.checkpoint for c in listing.committed if c.is_latest), None
                )
                off = abandoned((c.manifest for c in listing.committed), latest)
                off_line.update((run, slot) for slot in off)
            for committed in listing.committed:
                name = committed.manifest.checkpoint
                entry = merged.setdefault(
                    (run, name), TieredCheckpoint(run, committed.manifest, [], [])
                )
                entry.tiers.append(listing.tier)
                if committed.is_latest:
                    entry.latest_in.append(listing.tier)
                    entry.latest = entry.latest or listing.tier == first
    if len(errors) == len(tiers):
        raise next(iter(errors.values()))
    for key, entry in merged.items():
        entry.abandoned = key in off_line
    ordered = sorted(
        merged.values(),
        key=lambda c: (c.run, _step_key(c.manifest), c.manifest.committed_at),
    )
    return TieredListing(ordered, errors)


@dataclass(frozen=True)
class TierVerification:
    """One tier's verification of a checkpoint (``verify_across_tiers``)."""

    tier: str
    manifest: Manifest | None  # None: this tier does not hold the checkpoint
    problems: tuple[FileProblem, ...] = ()

    @property
    def held(self) -> bool:
        return self.manifest is not None


def verify_across_tiers(
    tiers: Sequence[TierStore],
    run_id: str,
    checkpoint: str | None,
    *,
    keys: KeyRing | None = None,
) -> list[TierVerification]:
    """Verify ``checkpoint`` (None: each tier's newest) in every tier, in order. With
    several tiers a tier that never held it (or has aged it out) is reported as not
    holding it, no mismatch; NotFoundError when no tier holds it (with one tier, that
    tier's own)."""
    many = len(tiers) > 1
    results: list[TierVerification] = []
    for tier in tiers:
        try:
            manifest = Repository(tier.storage).resolve(run_id, checkpoint)
        except NotFoundError:
            if not many:
                raise
            results.append(TierVerification(tier.name, None))
            continue
        problems = verify_checkpoint(
            tier.storage, manifest, concurrency=tier.config.concurrency, keys=keys
        )
        results.append(TierVerification(tier.name, manifest, tuple(problems)))
    if not any(r.held for r in results):
        raise NotFoundError(f"{run_id}/{checkpoint} is not committed in any tier")
    return results


class NothingCommittedError(NotFoundError):
    """No tier holds a committed checkpoint of the run, and every tier could be read."""


def require_roots(tiers: Sequence[TierStore]) -> None:
    """StorageError naming the first ``file://`` tier whose root directory is missing.

    To a listing, a missing root and an empty store look the same; but a root that is
    missing is most often a filesystem not mounted (or a typo), and that must never read
    as "nothing committed yet". Object stores need no such check: listing a bucket or
    container that does not exist is an error already."""
    for tier in tiers:
        if not tier.config.url.startswith("file://"):
            continue
        root = tier.config.root_path
        if not root.is_dir():
            raise StorageError(
                f"{tier.storage.url}: {root} is not a directory (a filesystem not mounted?): "
                "mount it, or create it for a new store",
                transient=False,
                code="NoSuchBucket",
                destination_unusable=True,
            )


@dataclass(frozen=True)
class TierRestore:
    """A restore over tiers: the result, and the tier it came from."""

    result: RestoreResult
    tier: str
    skipped_tiers: tuple[str, ...] = ()
    # Bytes by source: read from peers, and read from the store (the store's egress);
    # a restore from peers first has them counted by ``ckptd.peers.source.credited``.
    peer_bytes: int = 0
    store_bytes: int = 0


def newest_in_tiers(
    tiers: Sequence[TierStore], run_id: str, log: Any
) -> tuple[Manifest, list[TierStore]]:
    """``_newest`` without the manifests each tier's LATEST named."""
    best, holders, _ = _newest(tiers, run_id, log)
    return best, holders


def _newest(
    tiers: Sequence[TierStore], run_id: str, log: Any
) -> tuple[Manifest, list[TierStore], dict[str, Manifest]]:
    """The manifest of the newest checkpoint committed in any tier, and the tiers holding
    it (in order). NothingCommittedError when no tier holds one; when none holds one but
    some could not be read, that tier's error (it may hold the run's history)."""
    found: list[tuple[TierStore, Manifest]] = []
    error: StorageError | ManifestError | None = None
    for tier in tiers:
        try:
            found.append((tier, Repository(tier.storage).resolve(run_id, None)))
        except NotFoundError:
            continue
        except (StorageError, ManifestError) as exc:
            if len(tiers) > 1:  # with one tier, the error raised below says it (once)
                log.warning("restore_tier_unreadable", tier=tier.name, error=str(exc))
            error = error or exc
    if not found:
        if error is not None:
            raise error
        raise NothingCommittedError(f"run {run_id!r} has no committed checkpoint in any tier")
    # Each tier's LATEST names its live trajectory's newest; across tiers the newer
    # trajectory (``ckptd.commit.lineage``), then the higher step. max() keeps the first
    # of equals: the earliest tier wins a tie.
    _, best = max(found, key=lambda pair: (pair[1].lineage.generation, _step_key(pair[1])))
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
    return best, holders, {t.name: m for t, m in found}


def restore_from_tiers(tiers: Sequence[TierStore], request: RestoreRequest) -> TierRestore:
    """Restore ``request``'s checkpoint (None: the newest in any tier) from the first tier
    that holds it and whose copy verifies (module doc). The last tier's error is raised
    when none does."""
    from ckptd.runtime import logs

    run_id, checkpoint = request.run_id, request.checkpoint
    log = logs.get_logger(run=run_id)
    local = checkpoint
    read: dict[str, Manifest] = {}  # a tier's manifest of the newest, read already
    if checkpoint is None:
        newest, holders, found = _newest(tiers, run_id, log)
        name, local = newest.checkpoint, newest.local_name
        read = {t: m for t, m in found.items() if m.checkpoint == name}
    else:
        name, holders = checkpoint, list(tiers)
    skipped: list[str] = []
    last: Exception | None = None
    for index, tier in enumerate(holders):
        try:
            # A manifest read to find the newest is not read again.
            result = restore(
                tier.storage, replace(request, checkpoint=name), manifest=read.get(tier.name)
            )
            return TierRestore(
                result, tier.name, tuple(skipped), store_bytes=result.downloaded_bytes
            )
        except RestoreError as exc:
            if not exc.problems or os.path.lexists(request.target_dir / (local or name)):
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
    "NothingCommittedError",
    "TierListing",
    "TierRestore",
    "TierStore",
    "TierVerification",
    "TieredCheckpoint",
    "TieredListing",
    "list_across_tiers",
    "list_runs",
    "list_tiers",
    "newest_in_tiers",
    "open_tiers",
    "require_roots",
    "restore_from_tiers",
    "tier_configs",
    "verify_across_tiers",
]
