"""One checkpoint from many nodes' parts: announce, write the part, commit the union.

    announce  the node holding the framework's commit record writes ckptd.announce.json
              before it ships (``announce``); the other nodes wait for it. When that
              node's files change (a re-save under the same name) it withdraws the
              announcement and its part at once (``withdraw``), so no node pairs new
              files with the old save
    part      each node, once its files are uploaded and verified, writes
              ckptd.part-<rank>.json carrying the announced save (``write_part``)
    commit    a node that finds every rank's part of the announced save merges them
              (``ckptd.commit.parts.merge_parts``), checks every object in the store is
              the one its node wrote (its size, and the identity its part recorded:
              ``ckptd.commit.objects.not_as_written``), and commits the union with
              ``ckptd.commit.single``'s one
              conditional write (``try_commit``); exactly one node's write wins. The
              node whose part completes the set does so right after writing it; a node
              that only polls reads the parts when it is node 0, or when every part
              has been listed for ``TAKEOVER_POLLS`` of its polls (node 0 gone): so a
              commit costs N part reads, not N per node (``assemble=False``)

Every object of a save, its announcement, its parts and its manifest are in the one slot
its job's writer claimed (``ckptd.sync.claims.cluster_writer``): another job of the same
run id saving the same name is another writer, in another slot, and the name's one
conditional write commits one job's save whole; every node of the other job finds the
name committed by another writer (``try_commit``) and is refused as a conflict.

The store is the only coordinator: every step is an object read or written, so a daemon
killed anywhere repeats its step on restart (the announcement and part are rewritten
with the same content, the commit is conditional) and the nodes converge. A part of
another save than the announcement's is never merged, and a conflict is never committed.
Blocking functions (but ``judge_role``, which decides who announces and who follows):
run them in a thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from ckptd.commit import objects
from ckptd.commit.parts import (
    Announcement,
    Conflict,
    Merged,
    announcer_may_overwrite,
    epoch_of,
    merge_parts,
)
from ckptd.commit.single import (
    CommitConflictError,
    CommitResult,
    Slot,
    Writer,
    commit,
    committed_at,
    conflict,
    move_latest,
)
from ckptd.commit.slots import Withdrawal
from ckptd.core import digest
from ckptd.core.manifest import Manifest, ManifestError, build_manifest
from ckptd.core.signing import KeyRing
from ckptd.repository import Repository, announce_key, part_key

# Polls a node other than 0 waits, every part listed, before it assembles the commit
# itself (node 0, which would have, is gone or slow).
TAKEOVER_POLLS = 3


@dataclass(frozen=True)
class Committer:
    """Who commits: this node's host name and environment go into the global manifest."""

    nodes: int
    rank: int
    host: str
    environment: Mapping[str, str] = field(default_factory=dict)
    # The job's writer (``ckptd.sync.claims.cluster_writer``); "": not known (an
    # announcement is then taken whoever wrote it).
    writer: str = ""

    def owns(self, announcement: Announcement) -> bool:
        """Whether ``announcement`` is this node's job's (its writer's)."""
        return not self.writer or announcement.writer == self.writer


@dataclass(frozen=True)
class ClusterShip:
    """How one node ships its part of a many-node checkpoint."""

    committer: Committer
    save: str  # the save this node's files answer (its own when it announces)
    announcement: Announcement | None = None  # to write first: this node holds the record
    followed: Announcement | None = None  # a follower: the announcement it answers


def announced_slot(announcement: Announcement) -> Slot:
    """The slot every node of an announced save ships into (``ckptd.commit.slots``)."""
    slot = announcement.slot_name
    trajectory = announcement.trajectory.id if announcement.trajectory is not None else ""
    return Slot(announcement.checkpoint, slot, announcement.canonical or slot, trajectory)


class Assembly(Enum):
    COMMITTED = "committed"  # the global manifest is in the store (now or before)
    WAITING = "waiting"  # some node's part of this save is not there yet
    CONFLICT = "conflict"  # the parts disagree on a file, or another manifest holds the name
    RESAVED = "resaved"  # the announcement names another save than this node's part


@dataclass
class AssemblyResult:
    outcome: Assembly
    manifest: Manifest | None = None
    commit: CommitResult | None = None
    already_committed: bool = False
    missing: tuple[int, ...] = ()
    reason: str = ""
    conflict: Conflict | None = None
    announcement: Announcement | None = None


def announce(repo: Repository, announcement: Announcement) -> Announcement:
    """Write ``announcement`` in its slot unless one in force there wins over it
    (``announcer_may_overwrite``); returns the announcement in force afterwards."""
    existing = objects.read_announcement(repo, announcement.run_id, announcement.slot_name)
    if existing is not None and existing.save == announcement.save:
        return existing
    if not announcer_may_overwrite(existing, announcement.node_rank, announcement.save):
        assert existing is not None  # None always may be overwritten
        return existing
    objects.write_announcement(repo, announcement)
    return announcement


def withdraw(
    repo: Repository, run: str, name: str, rank: int, save: str, slot: str | None = None
) -> bool:
    """The announcing node's files changed (a re-save under the same name has begun):
    remove its announcement and its part of ``save`` in ``slot`` (None: the name's own),
    so no other node pairs its new files with the old save. Only objects of ``save`` by
    ``rank`` are removed; returns whether the announcement was."""
    where = slot or name
    announcement = objects.read_announcement(repo, run, where)
    slot = announcement.slot_name if announcement is not None else where
    gone = False
    if announcement is not None and (announcement.node_rank, announcement.save) == (rank, save):
        repo.delete([announce_key(run, where)])
        gone = True
    part = objects.read_part(repo, run, slot, rank)
    if part is not None and part.save == save:
        repo.delete([part_key(run, slot, rank)])
    return gone


def try_commit(
    repo: Repository,
    run: str,
    name: str,
    committer: Committer,
    *,
    save: str | None,
    now: float,
    keys: KeyRing | None = None,
    assemble: bool = True,
    slot: str | None = None,
) -> AssemblyResult:
    """Commit ``run/name`` if every part of the announced save is there (module doc);
    with ``assemble`` False, stop short of reading the parts once all are listed
    (WAITING, nothing missing: another node assembles).
    With ``keys`` the union carries the parts' digests and is signed by this node (every
    node holds the key; the parts are not signed, the manifest made of them is).

    ``save`` is the save this node's part answered (None: no opinion, as when a node
    only looks); an announcement of another save means this node's part is stale.
    ``slot`` is where this node's job ships the save (None: the name's own slot); an
    announcement there by another writer is not this job's and is never followed. The
    name committed by another writer (its manifest at the name's commit point, on the
    announced trajectory) is a CONFLICT: that content is never this job's."""
    where = slot or name
    announcement = objects.read_announcement(repo, run, where)
    if announcement is None or not committer.owns(announcement):
        return _unannounced(repo, run, name, where, committer)
    settled = _settled(repo, run, name, announcement, save)
    if settled is not None:
        return settled
    verdict = _gather_parts(repo, run, announcement, committer, assemble=assemble)
    if isinstance(verdict, AssemblyResult):
        return verdict
    return _commit_union(repo, run, name, announcement, verdict, committer, now=now, keys=keys)


def _unannounced(
    repo: Repository, run: str, name: str, where: str, committer: Committer
) -> AssemblyResult:
    """``try_commit`` with no announcement of this job in slot ``where``: COMMITTED when
    the name's manifest is already this slot's (moving LATEST, should a crash have come
    between the manifest and LATEST), else WAITING for every node."""
    existing = repo.read_manifest(run, name, follow=True)
    if existing is not None and existing.local_name == name and existing.checkpoint == where:
        move_latest(repo, existing)  # a crash between manifest and LATEST (commit.py)
        return AssemblyResult(Assembly.COMMITTED, existing, already_committed=True)
    return AssemblyResult(
        Assembly.WAITING, missing=tuple(range(committer.nodes)), reason="no announcement"
    )


def _settled(
    repo: Repository, run: str, name: str, announcement: Announcement, save: str | None
) -> AssemblyResult | None:
    """The outcome decided before any part is looked at, or None to go on: COMMITTED when
    the announced slot's commit point already holds this save's manifest, CONFLICT when it
    holds another writer's manifest or a withdrawal, RESAVED when the announcement names
    another save than this node's ``save``."""
    slot = announcement.slot_name
    found = committed_at(repo, run, announced_slot(announcement))
    if isinstance(found, Manifest) and found.checkpoint == slot:
        move_latest(repo, found)  # a crash between manifest and LATEST (commit.py)
        return AssemblyResult(Assembly.COMMITTED, found, already_committed=True)
    if isinstance(found, Manifest | Withdrawal):
        return AssemblyResult(
            Assembly.CONFLICT,
            reason=str(
                conflict(
                    run,
                    name,
                    found,
                    f"this job's save {announcement.save} in slot {slot} is never committed",
                )
            ),
            announcement=announcement,
        )
    if save is not None and announcement.save != save:
        return AssemblyResult(
            Assembly.RESAVED,
            reason=f"announced save {announcement.save} is not this node's {save}",
            announcement=announcement,
        )
    return None


def _gather_parts(
    repo: Repository,
    run: str,
    announcement: Announcement,
    committer: Committer,
    *,
    assemble: bool,
) -> Merged | AssemblyResult:
    """Every node's part of the announced save merged into one, or the result that stops
    short of it: WAITING while a rank's part is unlisted (or, with ``assemble`` False,
    once all are listed), or is of another save; CONFLICT when the parts disagree."""
    slot = announcement.slot_name
    # One LIST first: while a rank has no part object at all, no part is read (a waiting
    # checkpoint costs three requests a poll, however many nodes).
    listed = repo.part_ranks(run, slot)
    absent = tuple(r for r in range(committer.nodes) if r not in listed)
    if absent:
        return AssemblyResult(
            Assembly.WAITING,
            missing=absent,
            reason=f"waiting for node(s) {', '.join(map(str, absent))}",
            announcement=announcement,
        )
    if not assemble:
        return AssemblyResult(
            Assembly.WAITING,
            reason="every part is written; node 0 commits",
            announcement=announcement,
        )
    parts = objects.read_parts(repo, run, slot, listed)
    verdict = merge_parts(announcement, parts, committer.nodes)
    if isinstance(verdict, Conflict):
        return AssemblyResult(
            Assembly.CONFLICT,
            reason=verdict.describe(),
            conflict=verdict,
            announcement=announcement,
        )
    if not isinstance(verdict, Merged):
        reason = f"waiting for node(s) {', '.join(map(str, verdict.missing))}"
        if verdict.stale:
            reason += f" (part(s) of another save from {', '.join(map(str, verdict.stale))})"
        return AssemblyResult(
            Assembly.WAITING, missing=verdict.missing, reason=reason, announcement=announcement
        )
    return verdict


def _commit_union(
    repo: Repository,
    run: str,
    name: str,
    announcement: Announcement,
    merged: Merged,
    committer: Committer,
    *,
    now: float,
    keys: KeyRing | None,
) -> AssemblyResult:
    """The global manifest of every node's part of the announced save, committed unless
    an object is not as the parts list it (``try_commit``'s last step)."""
    manifest = build_manifest(
        run_id=run,
        checkpoint=announcement.slot_name,
        name=name,
        trajectory=announcement.trajectory,
        parent=announcement.parent,
        step=announcement.step,
        layout=announcement.layout,
        host=committer.host,
        created_at=epoch_of(merged.created_at) or now,
        committed_at=now,
        files=[(f.path, f.size, f.crc32c) for f in merged.files],
        environment=committer.environment,
        nodes=committer.nodes,
        save=announcement.save,
        suspect=merged.suspect,
        digests=(
            {f.path: f.digest for f in merged.files if f.digest} if keys is not None else None
        ),
        digest_algorithm=digest.ALGORITHM,
    )
    # Every object must be the one its node wrote (its size, and the identity its part
    # recorded): never a manifest over another writer's bytes at one of its keys.
    wrong = objects.not_as_written(
        repo,
        run,
        announcement.slot_name,
        [(f.path, f.size) for f in merged.files],
        merged.objects,
    )
    if wrong:
        # A part says verified, yet an object is gone, of another size or another write:
        # a node is re-shipping (a re-save), something deleted it, or another writer's
        # bytes are at its key. Never commit; wait for the parts to be written again.
        return AssemblyResult(
            Assembly.WAITING,
            missing=(),
            reason=f"{len(wrong)} object(s) not as the parts list them, e.g. {wrong[0]}",
            announcement=announcement,
        )
    if keys is not None:
        try:
            manifest = keys.sign(manifest)
        except ManifestError as exc:  # a part without digests: a node without the key
            return AssemblyResult(Assembly.CONFLICT, reason=str(exc), announcement=announcement)
    writer = Writer(
        announcement.writer or committer.writer or f"node-{announcement.node_rank}",
        committer.host,
    )
    try:
        result = commit(repo, manifest, announced_slot(announcement), writer, now=now)
    except CommitConflictError as exc:
        return AssemblyResult(Assembly.CONFLICT, reason=str(exc), announcement=announcement)
    return AssemblyResult(
        Assembly.COMMITTED,
        result.manifest,
        commit=result,
        already_committed=result.already_committed,
        announcement=announcement,
    )
