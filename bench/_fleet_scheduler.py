"""The fleet campaign's scheduler: one trace played on the wall clock against one policy's
cluster, playing the cloud (notices, kills, replacement hosts) and the cluster manager
(restarting the job).

Trace times are seconds from the job's first step (the first ``step`` line of any rank's
first log). For each event: a ``notice`` goes through the node's metadata fake at ``at``
and the node is *gone* at ``at + window``; a ``kill`` is gone at ``at``. Gone = every
process of the node SIGKILLed by PID, its host removed. ``replace_after`` seconds after a
node is gone a fresh host (new namespace, address, empty disk) takes its slot.

The cluster manager, the way a JobSet or a Kubernetes Job restarts a many-node job: the job
runs only whole. When a node is gone or a rank's process ends while others run, the
survivors get ``grace`` seconds to end by themselves (after a notice, ``ckptd exec`` commits
the emergency checkpoint and exits 0 on every node), then are SIGKILLed; once every slot has
a host, none is doomed (a notice pending), and nothing runs, every rank is started again
(``Cluster.launch``, with ``resume_for`` deciding a plain run's checkpoint). The campaign,
not ``ckptd exec``, restarts a job that lost a node: ``ckptd exec`` restarts a trainer that
crashed on a whole job, but cannot bring back a rank on another host, nor learn node 0's new
address; here every exec has ended (notice) or been killed (node gone) before the relaunch.

The invariant: every row of ``events.jsonl`` is written when the action was done, with
``t`` = time.time() then.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._fleet_cluster import Cluster, read_jsonl


@dataclass(order=True)
class Action:
    at: float  # seconds from the job's first step
    order: int
    kind: str = field(compare=False)  # notice | gone | replace
    nodes: tuple[int, ...] = field(compare=False)
    provider: str | None = field(compare=False, default=None)
    window: float = field(compare=False, default=0.0)
    replace_after: float = field(compare=False, default=0.0)


def actions_of(events: Any) -> list[Action]:
    out: list[Action] = []
    for i, ev in enumerate(events):
        nodes = tuple(int(n) for n in ev.nodes)
        if ev.kind == "notice":
            out.append(Action(ev.at, 2 * i, "notice", nodes, ev.provider, ev.window))
            gone_at = ev.at + ev.window
        else:
            gone_at = ev.at
        out.append(Action(gone_at, 2 * i + 1, "gone", nodes, ev.provider, 0, ev.replace_after))
    return sorted(out)


@dataclass
class Outcome:
    finished: bool
    wall_seconds: float
    launches: int
    note: str = ""


class Scheduler:
    """Plays ``events`` on ``cluster`` until every rank logged ``end`` or ``deadline``."""

    def __init__(
        self,
        cluster: Cluster,
        events: Any,
        *,
        deadline: float,
        grace: float = 8.0,
        resume_for: Callable[[Cluster], dict[int, Path] | None] | None = None,
        on_launch: Callable[[Cluster], None] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cluster = cluster
        self.pending = actions_of(events)
        self.deadline = deadline
        self.grace = grace
        self.resume_for = resume_for
        self.on_launch = on_launch
        self.say = log
        self.events_path = cluster.out / "events.jsonl"
        self.t0: float | None = None
        self.doomed: set[int] = set()
        self.replacements: list[tuple[float, int]] = []  # (wall time, rank)
        self.teardown_at: float | None = None
        self.launches = 0
        self.failed_launches = 0  # in a row, without a step
        self.max_failed_launches = 3

    def record(self, kind: str, nodes: tuple[int, ...], provider: str | None) -> None:
        row = {"kind": kind, "t": time.time(), "nodes": list(nodes), "provider": provider}
        with self.events_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def provider_for(self, rank: int, after: float) -> str:
        """The cloud of the next notice to hit this slot (a host has one cloud)."""
        for action in self.pending:
            if action.kind == "notice" and rank in action.nodes and action.at >= after:
                return action.provider or "aws"
        return "aws"

    def first_step(self) -> float | None:
        times = [
            row["t"]
            for slot in self.cluster.slots
            for row in read_jsonl(self.cluster.out / f"node{slot.rank}-a1.jsonl")
            if row.get("kind") == "step"
        ]
        return min(times) if times else None

    def ended(self) -> bool:
        """Every rank's latest log has its ``end``."""
        for slot in self.cluster.slots:
            rows = read_jsonl(self.cluster.out / f"node{slot.rank}-a{slot.starts}.jsonl")
            if not any(r.get("kind") == "end" for r in rows):
                return False
        return True

    def run(self) -> Outcome:
        began = time.time()
        for slot in self.cluster.slots:
            self.cluster.bring_up(slot.rank, self.provider_for(slot.rank, 0.0))
        self.launch()
        while True:
            now = time.time()
            if self.cluster.slots[0].starts and self.ended() and not self.cluster.running():
                return Outcome(True, now - began, self.launches)
            if self.failed_launches >= self.max_failed_launches:
                note = f"gave up: {self.failed_launches} launches in a row without a step"
                return Outcome(False, now - began, self.launches, note)
            if now - began > self.deadline:
                return Outcome(False, now - began, self.launches, "deadline passed")
            if self.t0 is None:
                self.t0 = self.first_step()
            if self.t0 is not None:
                self.play(now - self.t0)
            self.replace(now)
            self.manage(now)
            time.sleep(0.05)

    def play(self, rel: float) -> None:
        while self.pending and self.pending[0].at <= rel:
            action = self.pending.pop(0)
            if action.kind == "notice":
                for rank in action.nodes:
                    self.doomed.add(rank)
                    self.cluster.notice(rank, action.provider, action.window)
                self.record("notice", action.nodes, action.provider)
                self.say(f"  t={rel:6.1f}s notice {action.provider} nodes {list(action.nodes)}")
            else:
                gone = tuple(r for r in action.nodes if self.cluster.slots[r].host is not None)
                for rank in gone:
                    self.cluster.gone(rank)
                    self.doomed.discard(rank)
                    self.replacements.append((time.time() + action.replace_after, rank))
                if gone:
                    self.record("gone", gone, action.provider)
                    self.say(f"  t={rel:6.1f}s gone nodes {list(gone)}")
                if self.cluster.running() and self.teardown_at is None:
                    # ckptd exec commits and exits by itself after a notice: its grace
                    grace = self.grace if action.window and self.cluster.mode == "exec" else 0
                    self.teardown_at = time.time() + grace

    def replace(self, now: float) -> None:
        due = [(at, rank) for at, rank in self.replacements if at <= now]
        for item in due:
            self.replacements.remove(item)
            rank = item[1]
            rel = now - (self.t0 or now)
            self.cluster.bring_up(rank, self.provider_for(rank, rel))
            self.record("replaced", (rank,), self.cluster.slots[rank].provider)
            self.say(f"  t={rel:6.1f}s replaced node {rank}")

    def manage(self, now: float) -> None:
        running = self.cluster.running()
        whole = self.cluster.complete() and len(running) == len(self.cluster.slots)
        if running and not whole and self.teardown_at is None:
            # A rank ended: the job is broken (under ckptd exec: maybe its notice's exit).
            self.teardown_at = now + (self.grace if self.cluster.mode == "exec" else 0.0)
        if whole:
            self.teardown_at = None
        if self.teardown_at is not None and now >= self.teardown_at:
            self.cluster.stop_job()
            self.teardown_at = None
        if (
            not self.cluster.running()
            and self.cluster.complete()
            and not self.doomed
            and not self.ended()
        ):
            self.launch()

    def stepped(self) -> bool:
        """Whether the latest launch logged a step on any rank."""
        return any(
            row.get("kind") == "step"
            for slot in self.cluster.slots
            for row in read_jsonl(self.cluster.out / f"node{slot.rank}-a{slot.starts}.jsonl")
        )

    def launch(self) -> None:
        if self.launches:
            self.failed_launches = 0 if self.stepped() else self.failed_launches + 1
        if self.failed_launches >= self.max_failed_launches:
            return
        self.cluster.empty_disks()
        resume = self.resume_for(self.cluster) if self.resume_for else None
        self.cluster.launch(resume)
        self.launches += 1
        if self.on_launch is not None:
            self.on_launch(self.cluster)
