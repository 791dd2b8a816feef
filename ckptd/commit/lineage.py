"""Trajectories: which line of training a checkpoint belongs to, and where LATEST goes.

Pure: decisions from manifests and LATEST; no I/O, no clock.

A trainer that resumes from the run's newest checkpoint continues its trajectory. One
that resumes from an older checkpoint (a rollback after a loss spike, common practice in
LLM training) or from scratch under a run that has checkpoints starts a new trajectory:
its saves may reuse names the abandoned one used (``ckptd.commit.slots`` keeps both), and
from its first commit it is the live one.

**I3: LATEST names the newest checkpoint of the live trajectory.** Each trajectory has a
generation: the first is 0, a new one is one above the generation LATEST had when the
trainer resumed. A commit moves LATEST when its generation is higher, or when it is the
same trajectory and its step is not lower (``moves_latest``); a commit of an older
generation never does, so a zombie still saving on the abandoned trajectory cannot take
LATEST back. A new trajectory's id is derived from what it resumed from and what LATEST
named (``fork_id``), so every node of a job, and every tier, derives the same one.

**Abandoned** checkpoints are those off the live lineage: the live trajectory, then the
trajectory it forked from up to the fork's step, and so on (``live_lineage``). They stay
restorable by their slot, are listed as abandoned, and retention removes them first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from ckptd.commit.slots import letters
from ckptd.core.manifest import (
    ROOT_TRAJECTORY,
    SCRATCH,
    ForkPoint,
    Latest,
    Manifest,
    Parent,
    Trajectory,
    should_move_latest,
)


def content_id(manifest: Manifest) -> str:
    """A content's identity, the same in every tier and on every node: the SHA-256 (hex,
    16 digits) of its files' ``path\\tsize\\tcrc32c`` lines."""
    lines = "".join(f"{f.path}\t{f.size}\t{f.crc32c}\n" for f in manifest.files)
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


def fork_id(*identities: str) -> str:
    """A new trajectory's id (8 lowercase letters) from what identifies the fork."""
    digest = hashlib.sha256("\n".join(identities).encode()).digest()
    return letters(int.from_bytes(digest[:8], "big"))


@dataclass(frozen=True)
class Resumed:
    """The committed checkpoint a trainer resumed from."""

    manifest: Manifest

    @property
    def parent(self) -> Parent:
        m = self.manifest
        return Parent(checkpoint=m.checkpoint, step=m.step, manifest_crc32c=None)


def decide(
    resumed: Resumed | Literal["scratch"] | None,
    latest: Latest | None,
    latest_manifest: Manifest | None,
) -> Trajectory:
    """The trajectory of a trainer that resumed from ``resumed`` (None: not known) while
    LATEST named ``latest`` (whose manifest is ``latest_manifest``, when read)."""
    live = latest_manifest.lineage if latest_manifest is not None else ROOT_TRAJECTORY
    if latest is None:
        return resumed.manifest.lineage if isinstance(resumed, Resumed) else ROOT_TRAJECTORY
    if resumed is None:
        return live  # not told: the trainer is taken to continue the live trajectory
    latest_id = content_id(latest_manifest) if latest_manifest is not None else latest.checkpoint
    if resumed == SCRATCH:
        return Trajectory(
            id=fork_id("scratch", latest.checkpoint, latest_id),
            generation=latest.lineage[1] + 1,
            from_scratch=True,
        )
    assert isinstance(resumed, Resumed)
    parent = resumed.manifest
    same_line = parent.lineage.id == latest.lineage[0]
    at_or_past_tip = parent.step is None or latest.step is None or parent.step >= latest.step
    if parent.checkpoint == latest.checkpoint or (same_line and at_or_past_tip):
        return parent.lineage
    return Trajectory(
        id=fork_id(parent.checkpoint, content_id(parent), latest.checkpoint, latest_id),
        generation=latest.lineage[1] + 1,
        forked_from=ForkPoint(
            checkpoint=parent.checkpoint, step=parent.step, trajectory=parent.lineage.id
        ),
    )


def moves_latest(current: Latest | None, step: int | None, trajectory: Trajectory) -> bool:
    """Whether a commit of ``step`` on ``trajectory`` moves LATEST (module doc)."""
    if current is None:
        return True
    current_id, current_generation = current.lineage
    if trajectory.generation != current_generation:
        return trajectory.generation > current_generation
    if trajectory.id != current_id:
        return False  # a sibling of the live trajectory, of its generation: never
    return should_move_latest(current, step)


def live_lineage(live: Trajectory, known: Mapping[str, Trajectory]) -> dict[str, int | None]:
    """The live lineage: trajectory id -> the highest step on it that is live (None: all
    of it). ``known`` maps ids to trajectories as manifests record them (a fork's
    ``forked_from`` names the trajectory it left and where)."""
    lineage: dict[str, int | None] = {live.id: None}
    current = live
    while current.forked_from is not None:
        fork = current.forked_from
        if fork.trajectory in lineage:
            break  # a loop in garbage: stop rather than spin
        lineage[fork.trajectory] = fork.step
        current = known.get(fork.trajectory, Trajectory(id=fork.trajectory, generation=0))
    return lineage


def abandoned(manifests: Iterable[Manifest], latest_slot: str | None) -> set[str]:
    """The slots of the committed checkpoints off the live lineage (module doc), LATEST
    naming ``latest_slot``; none when that is no committed checkpoint (nothing says which
    line is live)."""
    found = list(manifests)
    by_slot = {m.checkpoint: m for m in found}
    head = by_slot.get(latest_slot) if latest_slot is not None else None
    if head is None:
        return set()
    known = {m.lineage.id: m.lineage for m in found}
    lineage = live_lineage(head.lineage, known)
    out = set()
    for m in found:
        if m.lineage.id not in lineage:
            out.add(m.checkpoint)
            continue
        bound = lineage[m.lineage.id]
        if bound is not None and m.step is not None and m.step > bound:
            out.add(m.checkpoint)
    return out


__all__ = [
    "Resumed",
    "abandoned",
    "content_id",
    "decide",
    "fork_id",
    "live_lineage",
    "moves_latest",
]
