"""What to delete, remotely and locally: pure policies, and the executors that apply them.

The policies (``plan_retention``, ``plan_orphans``, ``plan_local_cleanup``) are functions
of names, steps and settings: no I/O, no clock. The executors list, then delete.

Deletion runs in the reverse of the commit order (``ckptd.commit.single``): the manifest
goes **first**, then the objects. A run killed half-way therefore leaves at worst
objects without a manifest, which no reader takes for a committed checkpoint, and which
the next run collects as orphans. It never leaves a manifest naming a deleted object.

Orphans (a prefix under the run with objects but no manifest at all) are ambiguous: a
checkpoint being uploaded right now looks exactly like one whose deletion was cut short.
The store lists no upload in progress, and ``ObjectInfo`` carries no age, so the rule
is by step: an orphan is collected only when its step is older than the oldest of the
``keep_last`` newest committed checkpoints (or of all of them with ``keep_last = 0``).
An upload in flight is newer than what is already committed, save a stale one the
policy would delete the moment it committed anyway. An orphan without a step, one that
is protected (in flight on this node, being restored) or one whose manifest exists but
does not parse (a newer ckptd's format, say) is never touched.

Many nodes: a checkpoint whose parts never all arrived leaves an announcement and parts
(``ckptd.commit.parts``) beside its objects. Once its step is below the newest committed one
and its announcement is older than a grace period (``cluster_grace_seconds``), it can
never commit: ``sweep_cluster`` removes its announcement and parts (its objects are
orphans, collected by the rule above).

What a pass reads comes from a ``RunCatalog`` (``ckptd.store.catalog``) the daemon keeps
per run from one pass to the next: each committed manifest is read once, each name
deleted or collected costs nothing afterwards, so a pass after a commit costs the same
at the 2,000th checkpoint as at the 10th. An orphan is checked for a manifest with a
HEAD right before it is deleted, catalog or not.

A pass can be dry (``dry_run``, what ``ckptd prune`` does without ``--yes``): the same
reads and the same rules, with each deletion listed instead of made. Every deletion, made
or not, is handed to ``on_action`` as a ``RetentionAction`` (what, which run and name,
how many objects), in the order it is made.

Restores in progress announce themselves with a lease object (``ckptd.repository``
writes and reads them, JSON with the time it was taken); a checkpoint
with a lease younger than ``LEASE_TTL_SECONDS`` is protected, and older leases are
removed. A retention pass that lists the leases just before a restore writes its own can
still delete that checkpoint: the restore then fails verification and leaves nothing
under ``DIR/NAME``; it never yields a wrong checkpoint.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ckptd.commit import objects
from ckptd.commit.lineage import abandoned
from ckptd.commit.parts import epoch_of, superseded
from ckptd.commit.slots import trajectory_slot
from ckptd.commit.withdrawal import WITHDRAWAL_TTL_SECONDS, in_flight, withdraw
from ckptd.core.manifest import Manifest
from ckptd.layouts.base import step_of
from ckptd.repository import LEASE_TTL_SECONDS, Repository, manifest_key, redirect_target
from ckptd.storage.base import Storage
from ckptd.store.catalog import RunCatalog

Entry = tuple[str, int | None]
"""A checkpoint as the policies see it: ``(name, step)``; step None when unknown."""


# -- pure policies ---------------------------------------------------------------------


def plan_retention(
    committed: Sequence[Entry],
    *,
    keep_last: int,
    keep_every_steps: int,
    protected: Set[str] = frozenset(),
    keep_within: float = 0.0,
    committed_at: Mapping[str, float] | None = None,
    now: float | None = None,
    abandoned: Set[str] = frozenset(),
) -> list[str]:
    """Names of committed checkpoints to delete, oldest first.

    ``committed`` is oldest first. A checkpoint is kept when any rule keeps it (their
    union, as restic's ``--keep-within``): it is one of the newest ``keep_last``; its
    step is a multiple of ``keep_every_steps`` (when > 0; step 0 counts); it was
    committed within ``keep_within`` seconds before ``now`` (when > 0; by
    ``committed_at``, epoch seconds per name, one without a time is kept); it is in
    ``protected``; or it is the newest. With neither a count nor an age rule
    (``keep_last`` and ``keep_within`` 0) everything is kept. Checkpoints in
    ``abandoned`` (off the live trajectory, ``ckptd.commit.lineage``) go first: they rank
    below every live one for the count (kept only where the live ones leave room), and
    the step rule and "the newest" keep live ones only.
    """
    if keep_last < 0 or keep_every_steps < 0 or keep_within < 0:
        raise ValueError("keep_last, keep_every_steps and keep_within must be >= 0")
    if keep_last == 0 and keep_within == 0:
        return []
    if keep_within > 0 and (committed_at is None or now is None):
        raise ValueError("keep_within needs committed_at and now")
    live = [entry for entry in committed if entry[0] not in abandoned]
    # Abandoned ones rank below every live one: they fill the count only where the live
    # ones leave room, and go first when the count is exceeded.
    ranked = [entry for entry in committed if entry[0] in abandoned] + live
    newest = {name for name, _ in ranked[-keep_last:]} if keep_last > 0 else set()
    if live:
        newest.add(live[-1][0])  # the newest live checkpoint is never deleted
    victims: list[str] = []
    for name, step in committed:
        if name in newest or name in protected:
            continue
        if (
            keep_every_steps > 0
            and step is not None
            and step % keep_every_steps == 0
            and name not in abandoned
        ):
            continue
        if keep_within > 0 and _within(name, keep_within, committed_at, now):
            continue
        victims.append(name)
    return victims


def _within(
    name: str, seconds: float, committed_at: Mapping[str, float] | None, now: float | None
) -> bool:
    when = None if committed_at is None else committed_at.get(name)
    # A commit time that cannot be read is no reason to delete: kept.
    return when is None or now is None or now - when <= seconds


def kept_by_age(
    committed: Sequence[Entry], keep_within: float, committed_at: Mapping[str, float], now: float
) -> list[Entry]:
    """The entries ``keep_within`` alone keeps (oldest first)."""
    return [e for e in committed if _within(e[0], keep_within, committed_at, now)]


def plan_orphans(
    orphans: Sequence[Entry],
    committed: Sequence[Entry],
    *,
    keep_last: int,
    protected: Set[str] = frozenset(),
) -> list[str]:
    """Manifest-less prefixes safe to collect: step below the oldest step of the
    ``keep_last`` newest committed checkpoints (all with 0), not protected (module doc)."""
    window = committed[-keep_last:] if keep_last > 0 else committed
    steps = [step for _, step in window if step is not None]
    if not steps:
        return []  # nothing to measure "old" against: all of them may be uploads in flight
    floor = min(steps)
    return [
        name
        for name, step in orphans
        if step is not None and step < floor and name not in protected
    ]


def plan_local_cleanup(
    local: Sequence[Entry],
    committed_verified: Set[str],
    *,
    local_keep_last: int,
) -> list[str]:
    """Local checkpoints (``local`` oldest first) to delete: only ones committed
    remotely, never the newest ``local_keep_last``, never the newest one; 0 deletes none."""
    if local_keep_last < 0:
        raise ValueError("local_keep_last must be >= 0")
    if local_keep_last == 0 or not local:
        return []
    keep = {name for name, _ in local[-local_keep_last:]} | {local[-1][0]}
    return [name for name, _ in local if name not in keep and name in committed_verified]


# -- executors -------------------------------------------------------------------------

ActionKind = Literal["checkpoint", "orphan", "cluster", "lease"]


@dataclass(frozen=True)
class RetentionAction:
    """One deletion of a pass: a committed ``checkpoint`` (manifest first, then its
    objects), an ``orphan`` prefix, a ``cluster`` checkpoint's announcement and parts, or
    a stale restore ``lease`` (``name`` is then its key); ``objects`` removed (or, dry,
    that would be)."""

    kind: ActionKind
    run_id: str
    name: str
    objects: int


@dataclass
class Deletions:
    """Where a pass's deletions go: to the store, or with ``dry_run`` nowhere; each is
    reported to ``on_action`` either way."""

    repo: Repository
    run_id: str
    dry_run: bool = False
    on_action: Callable[[RetentionAction], None] | None = None
    made: list[RetentionAction] = field(default_factory=list)

    def _report(self, kind: ActionKind, name: str, objects: int) -> None:
        action = RetentionAction(kind, self.run_id, name, objects)
        self.made.append(action)
        if self.on_action is not None:
            self.on_action(action)

    def checkpoint(self, name: str, manifest: Manifest | None = None) -> int:
        """A committed checkpoint: its manifest first, then its objects (and the redirect
        naming it, ``delete_checkpoint``)."""
        if self.dry_run:
            objects = len(self.repo.list_objects(self.run_id, name))
        else:
            objects = delete_checkpoint(self.repo, self.run_id, name, manifest)
        self._report("checkpoint", name, objects)
        return objects

    def prefix(self, name: str, spare: Sequence[str] = ()) -> int:
        """Every object under a name with no manifest (an orphan), but ``spare``."""
        keys = [
            info.key for info in self.repo.list_objects(self.run_id, name) if info.key not in spare
        ]
        if not self.dry_run:
            self.repo.delete(keys)
        if keys:
            self._report("orphan", name, len(keys))
        return len(keys)

    def keys(self, kind: ActionKind, name: str, keys: list[str]) -> None:
        """``keys`` (a checkpoint's announcement and parts, or a lease) as one action."""
        if not self.dry_run:
            self.repo.delete(keys)
        if keys:
            self._report(kind, name, len(keys))


def _delete_prefix(repo: Repository, run_id: str, name: str) -> int:
    keys = [info.key for info in repo.list_objects(run_id, name)]
    repo.delete(keys)
    return len(keys)


def delete_checkpoint(
    storage: Storage | Repository, run_id: str, name: str, manifest: Manifest | None = None
) -> int:
    """Delete one committed checkpoint: its manifest first, then its objects; then the
    redirect that named its slot (``ckptd.commit.slots``: a content committed from a
    private slot), last, so the name is never free while the slot still holds a manifest.
    Returns how many objects went, the manifest included."""
    repo = storage if isinstance(storage, Repository) else Repository(storage)
    # Manifest first: from this instant no reader counts it committed, whatever follows.
    repo.delete([manifest_key(run_id, name)])
    count = 1 + _delete_prefix(repo, run_id, name)
    if manifest is not None and manifest.local_name != name:
        local = manifest.local_name
        for canonical in {local, trajectory_slot(local, manifest.lineage.id)}:
            body = repo.read_manifest_bytes(run_id, canonical)
            if body is not None and redirect_target(body) == name:
                repo.delete([manifest_key(run_id, canonical)])
    return count


def apply_retention(
    storage: Storage | Repository,
    run_id: str,
    *,
    keep_last: int,
    keep_every_steps: int,
    keep_within: float = 0.0,
    protected: Iterable[str] = (),
    collect_orphans: bool = True,
    now: float | None = None,
    lease_ttl_seconds: float = LEASE_TTL_SECONDS,
    cluster_grace_seconds: float | None = None,
    catalog: RunCatalog | None = None,
    dry_run: bool = False,
    on_action: Callable[[RetentionAction], None] | None = None,
) -> list[str]:
    """Apply the policy to ``run_id``; returns the names deleted (victims, then orphans).

    Never deletes what LATEST names, a name in ``protected`` (pass the checkpoints this
    node has in flight) or one with a fresh restore lease. Idempotent: rerun after a
    kill, it finishes the job (module doc). ``catalog`` (kept by the caller from one
    pass to the next) is what makes a pass cost the same however long the run
    (``ckptd.store.catalog``); without one, every manifest is read. ``dry_run`` deletes
    nothing and returns what it would delete; ``on_action`` hears of each deletion.
    """
    known = RunCatalog() if catalog is None else catalog
    repo = storage if isinstance(storage, Repository) else Repository(storage)
    deletions = Deletions(repo, run_id, dry_run=dry_run, on_action=on_action)
    with known.lock:  # one pass at a time per run: a commit's and a global commit's
        return _apply_retention(
            deletions,
            keep_last=keep_last,
            keep_every_steps=keep_every_steps,
            keep_within=keep_within,
            protected=protected,
            collect_orphans=collect_orphans,
            now=now,
            lease_ttl_seconds=lease_ttl_seconds,
            cluster_grace_seconds=cluster_grace_seconds,
            known=known,
        )


def _apply_retention(
    deletions: Deletions,
    *,
    keep_last: int,
    keep_every_steps: int,
    keep_within: float,
    protected: Iterable[str],
    collect_orphans: bool,
    now: float | None,
    lease_ttl_seconds: float,
    cluster_grace_seconds: float | None,
    known: RunCatalog,
) -> list[str]:
    from ckptd.runtime import logs  # here, not at the top: structlog imports asyncio

    repo, run_id, dry = deletions.repo, deletions.run_id, deletions.dry_run
    log = logs.get_logger(run=run_id)
    clock = time.time() if now is None else now
    guarded = set(protected)
    latest = repo.read_latest(run_id)
    if latest is not None:
        guarded.add(latest.checkpoint)
    leased, stale_leases = repo.read_leases(run_id, now=clock, ttl=lease_ttl_seconds)
    guarded |= leased

    known.refresh(repo, run_id, now=clock, window=keep_last)
    committed = known.entries()
    by_slot = {m.checkpoint: m for m in committed}
    entries = [(m.checkpoint, m.step) for m in committed]
    off_line = abandoned(committed, latest.checkpoint if latest is not None else None)
    times = {m.checkpoint: t for m in committed if (t := epoch_of(m.committed_at)) is not None}
    victims = plan_retention(
        entries,
        keep_last=keep_last,
        keep_every_steps=keep_every_steps,
        protected=guarded,
        keep_within=keep_within,
        committed_at=times,
        now=clock,
        abandoned=off_line,
    )
    deleted: list[str] = []
    for name in victims:
        objects = deletions.checkpoint(name, by_slot.get(name))
        known.settle(name)
        if not dry:
            log.info(
                "retention_deleted", checkpoint=name, objects=objects, abandoned=name in off_line
            )
        deleted.append(name)

    if collect_orphans and (keep_last > 0 or keep_within > 0):
        # The orphan floor: the count rule's window or, with the age rule alone, what
        # the age rule keeps (an upload in flight is newer than both).
        window = entries if keep_last > 0 else kept_by_age(entries, keep_within, times, clock)
        deleted += _collect_orphans(deletions, known, window, guarded, keep_last, clock)

    if cluster_grace_seconds is not None:
        sweep_cluster(
            repo,
            run_id,
            entries,
            skip=guarded | set(deleted),
            now=clock,
            grace_seconds=cluster_grace_seconds,
            candidates=sorted(known.uncommitted),
            deletions=deletions,
        )
    for key in stale_leases:
        deletions.keys("lease", key, [key])
    return deleted


def _collect_orphans(
    deletions: Deletions,
    known: RunCatalog,
    window: Sequence[Entry],
    guarded: Set[str],
    keep_last: int,
    now: float,
) -> list[str]:
    """Delete the manifest-less prefixes ``plan_orphans`` picks against ``window``, and
    what is left of withdrawn slots; returns their names (module doc). A slot is
    withdrawn before any of its objects goes, unless its claim is live (then it is kept);
    its withdrawal stays until ``WITHDRAWAL_TTL_SECONDS`` have passed
    (``ckptd.commit.withdrawal``). Each is settled in ``known`` once looked at, so a
    prefix the store keeps listing once emptied costs nothing on later passes."""
    from ckptd.runtime import logs

    repo, run_id = deletions.repo, deletions.run_id
    log = logs.get_logger(run=run_id)
    candidates = [(name, step_of(name)) for name in sorted(known.uncommitted)]
    picked = plan_orphans(candidates, window, keep_last=keep_last, protected=guarded)
    picked += sorted(set(known.withdrawn) - guarded - set(picked))
    collected: list[str] = []
    for name in picked:
        if name in known.withdrawn:
            when = known.withdrawn[name]
            spare = when is None or now - when < WITHDRAWAL_TTL_SECONDS
            if spare and name in known.emptied:
                continue  # only its withdrawal is left, and it stays a while yet
        else:
            writer = in_flight(repo, run_id, name, now)
            if writer is not None:
                log.info("retention_in_flight_kept", checkpoint=name, writer=writer.who())
                continue
            if not deletions.dry_run:
                # A manifest may have arrived since the catalog looked: the withdrawal
                # loses to it, and the name is kept.
                reason = "retention: no manifest, below the orphan floor, no live claim"
                withdrawal = withdraw(repo, run_id, name, by="retention", reason=reason, now=now)
                if withdrawal is None:
                    continue
                known.withdrawn[name] = epoch_of(withdrawal.withdrawn_at)
            spare = True
        objects = deletions.prefix(name, spare=[manifest_key(run_id, name)] if spare else [])
        if spare:
            known.emptied.add(name)  # its withdrawal goes once old enough
        else:
            known.settle(name)
        if objects:  # some stores list an emptied prefix for a while: nothing to do
            if not deletions.dry_run:
                log.info("retention_orphan_deleted", checkpoint=name, objects=objects)
            collected.append(name)
    return collected


def sweep_cluster(
    repo: Repository,
    run_id: str,
    committed: Sequence[Entry],
    *,
    skip: Set[str],
    now: float,
    grace_seconds: float,
    candidates: Sequence[str] | None = None,
    deletions: Deletions | None = None,
) -> list[str]:
    """Remove the announcement and parts of uncommitted checkpoints that can never commit
    (module doc); returns their names. One whose age cannot be read is kept. Looks at
    ``candidates`` (a catalog's uncommitted names), else at every name listed.
    ``deletions`` (a pass's) may make them dry, and hears of each."""
    from ckptd.runtime import logs

    sink = Deletions(repo, run_id) if deletions is None else deletions

    steps = [step for _, step in committed if step is not None]
    if not steps:
        return []
    newest = max(steps)
    committed_names = {name for name, _ in committed}
    swept: list[str] = []
    for name in repo.list_names(run_id) if candidates is None else candidates:
        step = step_of(name)
        if name.startswith(".") or name in committed_names or name in skip:
            continue
        if step is None or step >= newest or repo.has_manifest(run_id, name):
            continue
        announcement = objects.read_announcement(repo, run_id, name)
        since = epoch_of(announcement.announced_at) if announcement is not None else None
        if since is None:
            times = [
                epoch_of(p.verified_at) for p in objects.read_parts(repo, run_id, name).values()
            ]
            since = min((t for t in times if t is not None), default=None)
        if since is None or not superseded(step, newest, since, now, grace_seconds):
            continue
        keys = repo.cluster_keys(run_id, name)
        sink.keys("cluster", name, keys)
        if keys and not sink.dry_run:
            logs.get_logger(run=run_id).info(
                "retention_cluster_swept", checkpoint=name, objects=len(keys), newest_step=newest
            )
        if keys:
            swept.append(name)
    return swept


def apply_local_cleanup(
    watch_dir: Path,
    local: Sequence[Entry],
    committed_verified: Set[str],
    *,
    local_keep_last: int,
) -> list[str]:
    """Delete the local checkpoints ``plan_local_cleanup`` picks; returns their names.

    Only direct children of ``watch_dir`` are touched, a symlink never (neither it nor
    what it points at), and a directory is removed with ``shutil.rmtree``, which unlinks
    symlinks inside it without following them.
    """
    from ckptd.runtime import logs

    log = logs.get_logger(watch_dir=str(watch_dir))
    root = os.path.realpath(watch_dir)
    deleted: list[str] = []
    for name in plan_local_cleanup(local, committed_verified, local_keep_last=local_keep_last):
        if not name or "/" in name or "\x00" in name or name in (".", ".."):
            log.warning("local_cleanup_refused", checkpoint=name, reason="not a direct child")
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # the trainer's own rotation got there first
        if stat.S_ISLNK(st.st_mode):
            log.warning("local_cleanup_refused", checkpoint=name, reason="symlink")
            continue
        if os.path.dirname(path) != root:
            continue
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            continue
        log.info("local_checkpoint_deleted", checkpoint=name)
        deleted.append(name)
    return deleted


__all__ = [
    "Deletions",
    "RetentionAction",
    "apply_local_cleanup",
    "apply_retention",
    "delete_checkpoint",
    "kept_by_age",
    "plan_local_cleanup",
    "plan_orphans",
    "plan_retention",
    "sweep_cluster",
]
