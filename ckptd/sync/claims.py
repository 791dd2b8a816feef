"""This node's claims: the slot each local checkpoint ships into (``ckptd.commit.slots``).

``prepare`` is step 0 of the commit protocol (``ckptd.commit.single.prepare_slot``) for the
pipeline: done before the first object of a checkpoint is sent, early ones included, and
again before its ship (what commits the name may have changed meanwhile). The slot is
kept in the journal (``claims``) before any object goes, so cleanup after a crash knows
which prefix is this node's, and a restart finds the same slot (its claim is this
writer's; a private slot's tag is derived from the writer, name and trajectory).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from ckptd.commit.single import Prepared, Slot, Writer, committed_at, prepare_slot
from ckptd.config import ClusterConfig
from ckptd.repository import Repository
from ckptd.runtime.clock import Clock
from ckptd.sync.journal import Journal


def cluster_writer(cluster: ClusterConfig) -> str:
    """The writer every node of one many-node job claims as, and only that job's nodes:
    ``cluster-<nodes>-<job_id>``. Every node of the job ships a save into the one slot its
    writer claims (early files included, before the save is announced); another job of
    the same run id (a relaunch beside a zombie of itself, a second submission) is another
    writer, so it gets a slot of its own (``ckptd.commit.slots``) and its save can only
    commit whole or be refused as a conflict, never share objects, parts or an
    announcement with this one. Without a job id (no ``cluster.job_id``, no launcher's)
    every job of the run is ``cluster-<nodes>``: one job at a time (docs/many-nodes.md)."""
    if cluster.job_id:
        return f"cluster-{cluster.nodes}-{cluster.job_id}"
    return f"cluster-{cluster.nodes}"


class Claims:
    """The slots this node ships into, by run, name and trajectory (module doc)."""

    def __init__(
        self, repo: Repository, journal: Journal, writer: Writer, clock: Clock, log: Any
    ) -> None:
        self.repo = repo
        self.journal = journal
        self.writer = writer
        self.clock = clock
        self.log = log
        self._slots: dict[tuple[str, str, str], Slot] = {}

    @classmethod
    def of(
        cls, repo: Repository, journal: Journal, cluster: ClusterConfig, clock: Clock, log: Any
    ) -> Claims:
        """This node's claims: as the journal's writer on this host; with many nodes, as
        the job's (``cluster_writer``): every node of a save claims the same slot, and so
        ships into it, early files included, before the save is announced."""
        host = socket.gethostname()
        if cluster.multi_node:
            writer = Writer(cluster_writer(cluster), host, cluster.rank)
        else:
            writer = Writer(journal.writer, host)
        return cls(repo, journal, writer, clock, log)

    def forget(self, run: str, name: str) -> None:
        """``name``'s slots were emptied and their claims removed (``cleanup.discard``):
        the next content claims afresh."""
        for key in [k for k in self._slots if k[:2] == (run, name)]:
            del self._slots[key]

    def known(self, run: str, name: str, trajectory: str) -> Slot | None:
        """The slot prepared for this content before (this process, or the journal's)."""
        key = (run, name, trajectory)
        slot = self._slots.get(key)
        if slot is None:
            slot = self.journal.claim_for(run, name, trajectory)
            if slot is not None:
                self._slots[key] = slot
        return slot

    async def prepare(self, run: str, name: str, trajectory: str) -> Prepared:
        """The slot ``name``'s content on ``trajectory`` ships into, claimed and journalled,
        and what commits the name there already (``prepare_slot``)."""

        known = self.known(run, name, trajectory)

        def work() -> Prepared:
            if known is not None:  # claimed already: only what commits the name may be new
                return Prepared(known, committed_at(self.repo, run, known))
            prepared = prepare_slot(
                self.repo, run, name, trajectory, self.writer, self.clock.time()
            )
            if prepared.slot is not None:
                self.journal.record_claim(run, prepared.slot)
            return prepared

        prepared = await asyncio.to_thread(work)
        if prepared.slot is not None and known is None:
            self._slots[(run, name, trajectory)] = prepared.slot
            if prepared.slot.private:
                self.log.warning(
                    "checkpoint_slot_private",
                    run=run,
                    checkpoint=name,
                    slot=prepared.slot.slot,
                    canonical=prepared.slot.canonical,
                    reason="another writer holds the name's slot on this trajectory: this "
                    "content ships into a slot of its own, and commits only if that writer "
                    "does not commit first",
                )
        return prepared
