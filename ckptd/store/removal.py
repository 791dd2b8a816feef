"""``ckptd rm RUN[/CHECKPOINT]``: one checkpoint, or a whole run, taken out of a store;
planned first (what a dry run shows), then applied.

The order of deletes keeps the store's promise at every instant, however far a removal
got before it was killed:

1. **LATEST first**, when it names what goes: moved to the newest committed checkpoint
   that stays (by step, then commit time, as ``ckptd list`` orders them), or removed
   when none stays (a whole run, or its only checkpoint). A reader following LATEST is
   therefore never sent to a checkpoint being deleted. This is the one move of LATEST
   backwards, and only by hand (``--force``); the next commit moves it forward again as
   ever (``should_move_latest``).
2. **Each manifest next**, then the checkpoint's objects (retention's order): from the
   manifest's deletion on, no reader counts it committed, so a removal cut short
   leaves at worst objects without a manifest, which retention collects as an orphan.
3. **Each uncommitted name withdrawn** before its objects go (``ckptd.commit.withdrawal``):
   a writer still uploading into it is then refused at its commit point and keeps its
   local copy, and never commits a manifest over what was deleted. A name committed
   between the plan and the withdrawal is kept (``kept`` step: run ``rm`` again). The
   withdrawal stays behind (retention collects it after ``WITHDRAWAL_TTL_SECONDS``).
4. For a whole run, **everything else under it** last (the run's CADENCE, ledger
   chunks, NOTICE, leases), the withdrawals of step 3 excepted.

Refused without ``force``, before anything is deleted: the checkpoint LATEST names (or
a run whose LATEST names a committed checkpoint), a checkpoint a restore is reading
now (a fresh lease), and a name a writer is uploading (a claim younger than
``CLAIM_LIVE_SECONDS``: the refusal names the writer's host, node and claim age). A name
with nothing under it is a NotFoundError.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptd.commit.lineage import abandoned
from ckptd.commit.withdrawal import in_flight, withdraw
from ckptd.core import checksum
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import Latest, ManifestError, parse_manifest
from ckptd.repository import (
    CommittedCheckpoint,
    Repository,
    latest_key,
    lease_prefix,
    manifest_key,
)
from ckptd.storage.base import NotFoundError
from ckptd.store.retention import delete_checkpoint


class RemovalRefusedError(CkptdError):
    """What ``rm`` was asked to remove needs ``--force`` (exit 1): LATEST names it, or
    a restore is reading it."""


@dataclass(frozen=True)
class RemovalStep:
    """One delete of a removal, in order: ``latest`` (moved to ``name``, or removed when
    ``name`` is empty), ``checkpoint`` (manifest first, then its ``objects``),
    ``uncommitted`` (a name's objects, no manifest, withdrawn first), ``kept`` (an
    uncommitted name committed since the plan: nothing deleted), or ``rest`` (the run's
    other objects)."""

    kind: str
    name: str
    objects: int


@dataclass
class Removal:
    """What removing ``run_id[/checkpoint]`` from one store does (module doc)."""

    run_id: str
    checkpoint: str | None  # None: the whole run
    committed: list[str]  # committed checkpoints that go, each manifest first
    uncommitted: list[str]  # names without a (readable) manifest that go
    objects: int  # every object that goes, manifests and LATEST included
    latest: str | None  # what LATEST names now, if it changes
    latest_after: str | None  # what LATEST names afterwards (None: removed)
    steps: list[RemovalStep] = field(default_factory=list)
    # Uncommitted names a writer was uploading into (forced): host, node and claim age.
    uploading: dict[str, str] = field(default_factory=dict)

    @property
    def moves_latest(self) -> bool:
        return self.latest is not None


def _newest_staying(
    committed: list[CommittedCheckpoint], going: set[str], latest: str | None
) -> str | None:
    """The newest checkpoint that stays, on the live trajectory's lineage where one stays
    there (``ckptd.commit.lineage.abandoned``: LATEST follows the live line)."""
    off_line = abandoned((c.manifest for c in committed), latest)
    staying = [c.manifest.checkpoint for c in committed if c.manifest.checkpoint not in going]
    live = [name for name in staying if name not in off_line]
    chosen = live or staying
    return chosen[-1] if chosen else None  # list_committed is oldest first


def plan_removal(
    repo: Repository,
    run_id: str,
    checkpoint: str | None,
    *,
    force: bool = False,
    now: float | None = None,
) -> Removal:
    """What removing ``run_id`` (``checkpoint`` None) or one checkpoint would delete;
    RemovalRefusedError for what needs ``force``, NotFoundError for nothing there."""
    latest = repo.read_latest(run_id)
    committed = repo.list_committed(run_id)
    committed_names = [c.manifest.checkpoint for c in committed]
    if checkpoint is None:
        names = repo.list_names(run_id)
        objects = len(repo.list_run_objects(run_id))
        if not objects:
            raise NotFoundError(f"run {run_id!r} is not in {repo.storage.url}: nothing to remove")
        going = set(committed_names)
        uncommitted = [n for n in names if n not in going and not n.startswith(".")]
        where = f"run {run_id!r}"
    else:
        objects = len(repo.list_objects(run_id, checkpoint))
        if not objects:
            raise NotFoundError(
                f"{run_id}/{checkpoint} is not in {repo.storage.url}: nothing to remove "
                f"(ckptd list --run {run_id} names what is)"
            )
        going = {checkpoint}
        uncommitted = [] if checkpoint in committed_names else [checkpoint]
        where = f"{run_id}/{checkpoint}"
    named = latest.checkpoint if latest is not None else None
    moves = named is not None and (checkpoint is None or named == checkpoint)
    if moves and named in committed_names and not force:
        raise RemovalRefusedError(
            f"{where}: LATEST names {run_id}/{named}, which a restore --latest would take: "
            "--force to remove it (LATEST then moves to the newest checkpoint that stays, "
            "or goes with the last one)"
        )
    leased, _ = repo.read_leases(run_id, now=time.time() if now is None else now)
    kept = repo.read_protections(run_id, now=time.time() if now is None else now)
    if (held := sorted(going & set(kept))) and not force:
        raise RemovalRefusedError(
            f"{where}: {', '.join(held)} is kept as a rollback target ({kept[held[0]]}: "
            f"docs/health.md, a lease under {lease_prefix(run_id)}): --force to remove it"
        )
    reading = sorted(going & leased)
    if reading and not force:
        raise RemovalRefusedError(
            f"{where}: a restore is reading {', '.join(reading)} now (a lease under "
            f"{lease_prefix(run_id)}): wait for it, or --force"
        )
    clock = time.time() if now is None else now
    uploading = {}
    for name in uncommitted:
        writer = in_flight(repo, run_id, name, clock)
        if writer is not None:
            uploading[name] = writer.who()
    if uploading and not force:
        name, who = next(iter(uploading.items()))
        raise RemovalRefusedError(
            f"{where}: {run_id}/{name} is being uploaded by {who}: wait for its commit, or "
            "--force (the writer is then refused at its commit and keeps its local copy)"
        )
    after = _newest_staying(committed, going, named) if moves else None
    return Removal(
        run_id,
        checkpoint,
        [n for n in committed_names if n in going],
        uncommitted,
        objects,
        named if moves else None,
        after,
        uploading=uploading,
    )


def _point_latest(repo: Repository, run_id: str, name: str | None) -> None:
    """LATEST at ``name``'s manifest, or removed when ``name`` is None."""
    if name is None:
        repo.delete([latest_key(run_id)])
        return
    body = repo.read_manifest_bytes(run_id, name)
    if body is None:  # removed meanwhile: readers fall back to a listing
        repo.delete([latest_key(run_id)])
        return
    manifest = parse_manifest(body)
    crc = checksum.to_hex(checksum.crc32c(body))
    lineage = manifest.lineage
    pointer = Latest(
        checkpoint=name,
        step=manifest.step,
        manifest_crc32c=crc,
        trajectory=lineage.id or None,
        generation=lineage.generation or None,
    )
    repo.write_latest(run_id, pointer)


def apply_removal(
    repo: Repository,
    removal: Removal,
    on_step: Callable[[RemovalStep], None] | None = None,
) -> Removal:
    """Delete what ``removal`` planned, in the module doc's order; ``removal`` with
    ``steps`` filled in (each also handed to ``on_step`` as it is done)."""

    def did(kind: str, name: str, objects: int) -> None:
        step = RemovalStep(kind, name, objects)
        removal.steps.append(step)
        if on_step is not None:
            on_step(step)

    run_id = removal.run_id
    if removal.moves_latest:
        _point_latest(repo, run_id, removal.latest_after)
        did("latest", removal.latest_after or "", 1)
    for name in removal.committed:
        # Retention's delete: the manifest first, then the objects, then a redirect to it.
        try:
            manifest = repo.read_manifest(run_id, name)
        except ManifestError:
            manifest = None
        did("checkpoint", name, delete_checkpoint(repo, run_id, name, manifest))
    withdrawn: set[str] = set()
    for name in removal.uncommitted:
        reason = "ckptd rm --force" if name in removal.uploading else "ckptd rm"
        if withdraw(repo, run_id, name, by="rm", reason=reason, now=time.time()) is None:
            did("kept", name, 0)  # committed (or redirected) since the plan
            continue
        marker = manifest_key(run_id, name)
        withdrawn.add(marker)
        keys = [info.key for info in repo.list_objects(run_id, name) if info.key != marker]
        repo.delete(keys)
        did("uncommitted", name, len(keys))
    if removal.checkpoint is None:
        rest = [info.key for info in repo.list_run_objects(run_id) if info.key not in withdrawn]
        repo.delete(rest)
        did("rest", run_id, len(rest))
    return removal


__all__ = [
    "Removal",
    "RemovalRefusedError",
    "RemovalStep",
    "apply_removal",
    "plan_removal",
]
