"""One node's side of many-node checkpoints, as the pipeline meets them.

With many nodes (``cluster.nodes > 1``) the verdict on a checkpoint has two sources
(``judge``): a node whose own rule holds on the commit record announces the save and
ships; any other node waits until ``poll`` finds the checkpoint announced, then ships
once its own files are quiet and closed (``ckptd.commit.parts`` says why that is
enough, per framework). A part written but not yet joined by every node's is "waiting"
(``waiting``): ``poll`` tries the global commit again every
``cluster.poll_interval_seconds`` and hands each global commit it makes or finds back to
the pipeline, which acts on it as on its own ship's. A waiting checkpoint below the
newest committed step is given up after a grace period (``superseded``); a save whose
files changed under its announcement is withdrawn (``withdraw_if_resaved``).

The bookkeeping lives in each ``RunState`` (``announcements``, ``awaiting``, ``waiting``);
this class is its only writer but for ``judge_role``. With one node every method is
inert and ``judge`` is the completion rule's verdict, unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ckptd import layouts
from ckptd.commit import objects
from ckptd.commit.assemble import (
    TAKEOVER_POLLS,
    Assembly,
    AssemblyResult,
    ClusterShip,
    Committer,
    try_commit,
    withdraw,
)
from ckptd.commit.parts import (
    ABANDON_GRACE_SECONDS,
    Announcement,
    files_fit_save,
    is_announcer,
    save_id,
    save_tail_seconds,
)
from ckptd.commit.parts import (
    superseded as save_superseded,
)
from ckptd.commit.single import CommitConflictError, Slot, conflict
from ckptd.commit.slots import Withdrawal
from ckptd.core.manifest import Manifest, utc_timestamp
from ckptd.core.signing import KeyRing
from ckptd.layouts.base import CheckpointListing, Completion, not_complete, settled, step_of
from ckptd.repository import Repository
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import StorageError
from ckptd.sync.claims import Claims
from ckptd.sync.queue import EMERGENCY_MTIME_SLACK, Pending, ShipQueue
from ckptd.sync.runs import RunState, WaitingEntry, lineage_of, previous_manifest
from ckptd.sync.ship import ClusterConflictError, Outcome, ShipResult

# What ``poll`` hands back for each global commit: the run, the checkpoint as if it had
# been queued, and the outcome as a ship of its own would have carried it.
GlobalCommit = tuple[RunState, Pending, ShipResult]

# A node awaiting its job's announcement reads what commits the name (another job may
# have committed it: a conflict) on its first look and then every this many polls.
COMMIT_POINT_POLLS = 5


def judge_role(
    state: RunState,
    listing: CheckpointListing,
    verdict: Completion,
    committer: Committer,
    now: float,
) -> tuple[Completion, ClusterShip | None]:
    """The verdict on one node's files of a checkpoint, and how the node ships them: as
    the announcer (its rule holds on the commit record, and no lower rank leads the
    save), or as a follower of the announced save (``state.announcements``) once its files
    fit that save and are quiet and closed. Otherwise incomplete, and the checkpoint is
    noted in ``state.awaiting`` for ``poll_cluster`` to look for its announcement."""
    name = listing.name
    known = state.announcements.get(name)
    own = save_id((f.path, f.size, f.mtime_ns) for f in listing.files)
    if is_announcer(verdict.layout, verdict.complete, committer.rank) and (
        known is None or known.save == own or known.node_rank >= committer.rank
    ):
        announcement = Announcement(
            run_id=state.run_id,
            checkpoint=name,
            save=own,
            node_rank=committer.rank,
            layout=verdict.layout,
            step=step_of(name),
            announced_at=utc_timestamp(now),
            record_mtime_ns=listing.newest_mtime_ns,
        )
        state.awaiting.pop(name, None)
        return verdict, ClusterShip(committer, own, announcement)
    if known is not None and known.node_rank == committer.rank:
        known = None  # this node's own earlier save (it re-saves): never followed
    if known is None or not files_fit_save(
        listing.newest_mtime_ns, known, save_tail_seconds(known.layout)
    ):
        state.awaiting.setdefault(name, now)
        why = (
            "waiting for the node with the commit record to announce it"
            if known is None
            else f"files newer than announced save {known.save}: waiting for a later one"
        )
        # Keep the rule's own recheck: on the record's node the verdict may be
        # "complete but for a quiet window".
        return not_complete(verdict.layout, why, verdict.recheck_after), None
    judged = settled(
        known.layout,
        listing,
        int(now * 1e9),
        state.rules.settle_seconds,
        f"announced by node {known.node_rank}; this node's files are quiet and closed",
    )
    if not judged.complete:
        return judged, None
    state.awaiting.pop(name, None)
    return judged, ClusterShip(committer, known.save, followed=known)


class ClusterCoordination:
    """This node's announcements, parts and global commits (module doc)."""

    def __init__(
        self,
        committer: Committer | None,
        runs: Mapping[str, RunState],
        repo: Repository,
        queue: ShipQueue,
        metrics: Metrics,
        clock: Clock,
        log: Any,
        *,
        keys: KeyRing | None,
        look_again: Callable[[str, str, float], None],
        changed: Callable[[], None],
        claims: Claims | None = None,
    ) -> None:
        self.committer = committer  # None: one node
        # The job's claims (``ckptd.sync.claims``): the slot this node's job ships a name
        # into, where a job other than the name's canonical owner announces its save.
        self.claims = claims
        self.runs = runs
        self.repo = repo
        self.queue = queue
        self.metrics = metrics
        self.clock = clock
        self.log = log
        self.keys = keys
        # The pipeline's ``hint`` (look at one checkpoint again after a delay), and its
        # gauges' refresh after a change.
        self._look_again = look_again
        self._changed = changed
        # A checkpoint below the newest committed step, waiting longer than this, is given
        # up (``cluster.superseded``), here and by retention's sweep.
        self.abandon_grace_seconds = ABANDON_GRACE_SECONDS
        # Per waiting checkpoint: this node's polls in a row that found every part listed
        # and left the reading of the parts to node 0 (``assemble.TAKEOVER_POLLS``).
        self._all_listed: dict[tuple[str, str], int] = {}
        # Per checkpoint: the slot its save ships into (learnt from its announcement),
        # the listing a follower awaits an announcement for (its trajectory, so its own
        # slot), the slot this node claimed, and its looks at the commit point.
        self._slots: dict[tuple[str, str], str] = {}
        self._listings: dict[tuple[str, str], CheckpointListing] = {}
        self._own: dict[tuple[str, str], Slot] = {}
        self._looks: dict[tuple[str, str], int] = {}

    @property
    def whole_prefix(self) -> bool:
        """Whether a checkpoint's whole prefix is this node's (one node) to discard."""
        return self.committer is None

    def judge(
        self, state: RunState, listing: CheckpointListing
    ) -> tuple[Completion, ClusterShip | None]:
        """The verdict on ``listing`` and, with many nodes, how this node ships it: as the
        announcer (its rule holds on the commit record) or as a follower of the save the
        store announced (module doc). One node: the rule's verdict, unchanged."""
        verdict = layouts.evaluate(
            state.watch.layout, listing, int(self.clock.time() * 1e9), state.rules
        )
        if self.committer is None:
            return verdict, None
        judged = judge_role(state, listing, verdict, self.committer, self.clock.time())
        if listing.name in state.awaiting:
            self._listings[(state.run_id, listing.name)] = listing
        return judged

    def _slot_of(self, run: str, name: str) -> str | None:
        """The slot this node's job ships ``run/name`` into, as far as it knows (None: the
        name's own, as before slots). Blocking (the journal)."""
        key = (run, name)
        if key in self._slots:
            return self._slots[key]
        own = self._own.get(key)
        if own is not None:
            return own.slot
        if self.claims is not None:
            slots = self.claims.journal.slots_of(run, name)
            if len(slots) == 1:
                return slots[0]
        return None

    async def _job_announcement(
        self, state: RunState, name: str, committer: Committer
    ) -> Announcement | CommitConflictError | None:
        """The announcement of ``name`` by this node's job (``Committer.owns``): in the
        name's own slot, else in the slot this node claims for it (another job holds the
        name's: ``ckptd.sync.claims.cluster_writer``). Another job's announcement is never
        followed. On the first look and every ``COMMIT_POINT_POLLS`` the commit point is
        read too: the name committed (or withdrawn) under another writer means this job's
        save can never commit, a conflict (returned)."""
        run, key = state.run_id, (state.run_id, name)
        found = await asyncio.to_thread(objects.read_announcement, self.repo, run, name)
        if found is not None and committer.owns(found):
            return found
        looks = self._looks[key] = self._looks.get(key, 0) + 1
        listing = self._listings.get(key)
        if self.claims is not None and listing is not None and looks % COMMIT_POINT_POLLS == 1:
            trajectory, _ = await lineage_of(state, listing)
            prepared = await self.claims.prepare(run, name, trajectory.id)
            if prepared.slot is not None:
                self._own[key] = prepared.slot
            theirs = prepared.committed
            mine = prepared.slot.slot if prepared.slot is not None else None
            if isinstance(theirs, Withdrawal) or (
                isinstance(theirs, Manifest) and theirs.checkpoint != mine
            ):
                return conflict(
                    run,
                    name,
                    theirs,
                    "another writer's content commits the name; this "
                    "job's save of it can never commit",
                )
        own = self._own.get(key)
        if own is not None and own.slot != name:
            found = await asyncio.to_thread(objects.read_announcement, self.repo, run, own.slot)
            if found is not None and committer.owns(found):
                return found
        return None

    def _forget(self, run: str, name: str) -> None:
        key = (run, name)
        self._slots.pop(key, None)
        self._listings.pop(key, None)
        self._own.pop(key, None)
        self._looks.pop(key, None)

    def part_written(self, run: str, name: str) -> bool:
        """Many nodes: whether this node's part of ``run/name`` is in the store (its
        objects then belong to a save the other nodes may still complete): in the slot
        its job's announcement names, or any slot this node claimed for it. Blocking."""
        committer = self.committer
        if committer is None:
            return False
        slots = {name, *(self.claims.journal.slots_of(run, name) if self.claims else [])}
        announcement = objects.read_announcement(self.repo, run, name)
        if announcement is not None and committer.owns(announcement):
            slots.add(announcement.slot_name)
        return any(objects.read_part(self.repo, run, s, committer.rank) for s in slots)

    async def superseded(
        self, state: RunState, name: str, since: float, *, refresh: bool = False
    ) -> bool:
        """Many nodes: whether a checkpoint (waiting or written since ``since``) can never
        commit any more (``cluster.superseded``); if so it is given up and left alone.
        ``refresh`` reads LATEST again: another node may have committed a later step."""
        previous = await previous_manifest(self.repo, state, self.log)
        steps = [state.last_step, previous.step if previous else None]
        if refresh:
            latest = await asyncio.to_thread(self.repo.read_latest, state.run_id)
            steps.append(latest.step if latest else None)
        newest = max((s for s in steps if s is not None), default=None)
        entry = state.waiting.get(name)
        since = min(since, entry.since) if entry else since
        if not save_superseded(
            step_of(name), newest, since, self.clock.time(), self.abandon_grace_seconds
        ):
            return False
        state.forget_cluster(name)
        self.queue.remove(state.run_id, name)
        state.failed_for_good[name] = (
            f"superseded: step {newest} committed and not every node's part arrived"
        )
        self.log.warning(
            "checkpoint_superseded", run=state.run_id, checkpoint=name, newest_step=newest
        )
        self._changed()
        return True

    async def withdraw_if_resaved(self, state: RunState, listing: CheckpointListing) -> None:
        """Many nodes: this node announced a save whose files have since changed (a
        re-save under the same name): withdraw it (``assemble.withdraw``)."""
        committer = self.committer
        if committer is None:
            return
        run, name = state.run_id, listing.name
        entry = state.waiting.get(name)
        known = state.announcements.get(name)  # after a restart: found by poll
        if entry is not None and entry.announced:
            save = entry.save
        elif known is not None and known.node_rank == committer.rank:
            save = known.save
        else:
            return
        if save_id((f.path, f.size, f.mtime_ns) for f in listing.files) == save:
            return
        state.waiting.pop(name, None)
        state.announcements.pop(name, None)
        try:
            slot = await asyncio.to_thread(self._slot_of, run, name)
            await asyncio.to_thread(withdraw, self.repo, run, name, committer.rank, save, slot)
        except StorageError as exc:
            self.log.warning(
                "announcement_withdraw_failed", run=run, checkpoint=name, error=str(exc)
            )
            return
        self.log.info("announcement_withdrawn", run=run, checkpoint=name, save=save)
        self._changed()

    def conflict(self, state: RunState, name: str, error: Exception | None, log: Any) -> None:
        """Never committed: a manifest of other content holds the name, or (many nodes)
        two nodes' parts differ on a file."""
        state.forget_cluster(name)
        state.failed_for_good[name] = str(error)
        self.metrics.failed.labels(run=state.run_id, reason="conflict").inc()
        if isinstance(error, ClusterConflictError):
            self.metrics.cluster_conflicts.labels(run=state.run_id).inc()
        log.error("checkpoint_conflict", error=str(error))
        self._changed()

    def waiting(
        self,
        state: RunState,
        name: str,
        role: ClusterShip | None,
        assembly: AssemblyResult | None,
        log: Any,
        *,
        emergency: bool = False,
    ) -> None:
        """Many nodes: this node's part is written (or another node leads the save);
        ``poll`` takes it from here."""
        if assembly is not None and assembly.outcome is Assembly.RESAVED:
            # Another save is announced than the one just shipped: follow it.
            if assembly.announcement is not None:
                state.announcements[name] = assembly.announcement
            state.waiting.pop(name, None)
            log.info("checkpoint_follows_announcement", reason=assembly.reason)
            self._look_again(state.run_id, name, 0.0)
            return
        if role is None:
            return
        announced = assembly.announcement if assembly is not None else None
        announced = announced or role.followed
        if announced is not None:
            self._slots[(state.run_id, name)] = announced.slot_name
        entry = state.waiting.get(name)
        if entry is None or entry.save != role.save:
            entry = state.waiting[name] = WaitingEntry(role.save, self.clock.time())
        entry.announced = role.announcement is not None
        entry.emergency = entry.emergency or emergency
        if assembly is not None:
            entry.missing, entry.reason = assembly.missing, assembly.reason
        log.info("checkpoint_waiting_for_nodes", missing=list(entry.missing), reason=entry.reason)
        self._changed()

    async def poll(self) -> AsyncIterator[GlobalCommit]:
        """Many nodes, one look at the store: announcements this node waits for, and the
        global commit of checkpoints whose part is written (``assemble.try_commit``).
        Yields each global commit, for the pipeline to act on before the look goes on."""
        committer = self.committer
        if committer is None:
            return
        for state in self.runs.values():
            run = state.run_id
            for name in list(state.awaiting):
                if name in state.committed or name in state.failed_for_good:
                    state.awaiting.pop(name, None)
                    self._forget(run, name)
                    continue
                found = await self._job_announcement(state, name, committer)
                if isinstance(found, CommitConflictError):
                    state.awaiting.pop(name, None)
                    self._forget(run, name)
                    log = self.log.bind(run=run, checkpoint=name)
                    self.conflict(state, name, ClusterConflictError(str(found)), log)
                    continue
                known = state.announcements.get(name)
                if found is not None and (known is None or known.save != found.save):
                    state.announcements[name] = found
                    self.log.info(
                        "checkpoint_announced_by", run=run, checkpoint=name, node=found.node_rank
                    )
                    self._look_again(run, name, 0.0)
            for name, entry in list(state.waiting.items()):
                if await self.superseded(state, name, entry.since):
                    continue
                listed = self._all_listed.get((run, name), 0)
                result = await asyncio.to_thread(
                    try_commit,
                    self.repo,
                    run,
                    name,
                    committer,
                    save=entry.save,
                    now=self.clock.time(),
                    keys=self.keys,
                    assemble=committer.rank == 0 or listed >= TAKEOVER_POLLS,
                    slot=await asyncio.to_thread(self._slot_of, run, name),
                )
                self._count_all_listed(run, name, result)
                if result.outcome is Assembly.COMMITTED:
                    yield self._global_commit(state, name, entry, result)
                else:
                    await self._after_assembly(state, name, entry, result, committer)

    def _count_all_listed(self, run: str, name: str, result: AssemblyResult) -> None:
        """Polls in a row that found every part listed, while waiting (``try_commit``'s
        ``assemble``); forgotten once the checkpoint stops waiting."""
        key = (run, name)
        if result.outcome is Assembly.WAITING and not result.missing and result.announcement:
            self._all_listed[key] = self._all_listed.get(key, 0) + 1
        else:
            self._all_listed.pop(key, None)

    @staticmethod
    def _global_commit(
        state: RunState, name: str, entry: WaitingEntry, result: AssemblyResult
    ) -> GlobalCommit:
        assert result.manifest is not None
        pending = Pending(
            state.run_id, name, result.manifest.step, entry.since, emergency=entry.emergency
        )
        shipped = ShipResult(
            Outcome.COMMITTED,
            result.manifest,
            already_committed=result.already_committed,
            commit=result.commit,
        )
        return state, pending, shipped

    async def _after_assembly(
        self,
        state: RunState,
        name: str,
        entry: WaitingEntry,
        result: AssemblyResult,
        committer: Committer,
    ) -> None:
        """Any assembly but a commit: a conflict, a part gone, a later save, still waiting."""
        log = self.log.bind(run=state.run_id, checkpoint=name)
        if result.outcome is Assembly.CONFLICT:
            self.conflict(state, name, ClusterConflictError(result.reason), log)
        elif committer.rank in result.missing and await self.superseded(
            state, name, 0.0, refresh=True
        ):
            # This node's part is gone (retention's sweep) and a later step is committed:
            # given up, never announced again.
            pass
        elif result.outcome is Assembly.RESAVED or committer.rank in result.missing:
            # A later save is announced, or this node's own part is gone: ship again
            # (the journal skips every object already sent; the part is rewritten).
            state.waiting.pop(name, None)
            if result.announcement is not None:
                state.announcements[name] = result.announcement
            else:  # withdrawn: wait for the next announcement
                state.announcements.pop(name, None)
            log.info("checkpoint_reshipping", reason=result.reason or "own part missing")
            self._changed()
            self._look_again(state.run_id, name, 0.0)
        elif (entry.missing, entry.reason) != (result.missing, result.reason):
            entry.missing, entry.reason = result.missing, result.reason
            log.info(
                "checkpoint_waiting_for_nodes", missing=list(entry.missing), reason=entry.reason
            )

    def awaiting_emergency(self, emergency_since: float | None) -> bool:
        """Many nodes, during a notice (since ``emergency_since``): a checkpoint that
        appeared since the notice waits for its announcement. That is this node's share
        of the emergency save, which the node with the commit record is about to
        announce: a SIGTERM flush waits for it."""
        if emergency_since is None:
            return False
        since = emergency_since - EMERGENCY_MTIME_SLACK
        return any(t >= since for s in self.runs.values() for t in s.awaiting.values())

    def busy(self) -> bool:
        """Many nodes: a checkpoint still waits for an announcement or for other nodes."""
        return any(s.awaiting or s.waiting for s in self.runs.values())
