"""Which local checkpoint a (re)started trainer resumes from: the newest complete one on
the live line.

"On the live line" (``on_line``, from ``ckptd.sync.lineage.RunLineage.live_line``): its
content belongs to the live trajectory, or to an ancestor of it up to the step the line
left it. After a rollback the watch dir still holds the abandoned line's higher steps
(``checkpoint-60`` beside the rollback's ``checkpoint-50``); resuming from one of those
would undo the rollback (a new trajectory forked from the abandoned line, which LATEST
would follow and retention would then keep over the rollback's). Without a known line
(``on_line`` None) every complete checkpoint counts, as before trajectories existed.

"Complete" is the run's own completion rule (``ckptd.layouts``), the same verdict that
decides what is shipped (or a checkpoint ``ckptd restore`` wrote and nothing changed since:
``ckptd.sync.lineage.restored_as``, no quiet window), so a trainer never resumes from a checkpoint the daemon would
refuse to commit (a DCP save without ``.metadata``, an HF save without
``trainer_state.json``). "Newest" is the highest step (the name's last run of digits);
among names without a step, or equal steps, the newest file wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptd import layouts
from ckptd.layouts.base import CheckpointListing, RuleSettings, step_of
from ckptd.sync.lineage import restored_as
from ckptd.sync.scanner import list_candidates, snapshot


@dataclass(frozen=True)
class LocalCheckpoint:
    path: Path
    step: int | None


@dataclass(frozen=True)
class ResumePoint:
    """The newest complete checkpoint (None: none), and when a newer one that is complete
    but for a quiet window should be looked at again (None: there is no such one)."""

    checkpoint: LocalCheckpoint | None
    recheck_after: float | None


def _rank(step: int | None, mtime_ns: int) -> tuple[int, int, int]:
    return (0, 0, mtime_ns) if step is None else (1, step, mtime_ns)


def find_resume_point(
    watch_dir: Path,
    layout: str,
    rules: RuleSettings,
    now_ns: int,
    on_line: Callable[[CheckpointListing], bool] | None = None,
) -> ResumePoint:
    """Look at every checkpoint under ``watch_dir`` now (blocking I/O: run it off the
    loop); ``on_line`` is asked, newest first, only until one complete checkpoint is on
    the line (it may read the store)."""
    complete: list[tuple[tuple[int, int, int], CheckpointListing]] = []
    waiting: list[tuple[tuple[int, int, int], float, CheckpointListing]] = []
    for name in list_candidates(watch_dir):
        listing = snapshot(watch_dir, name)
        if listing is None:
            continue
        verdict = layouts.evaluate(layout, listing, now_ns, rules)
        rank = _rank(step_of(name), listing.newest_mtime_ns)
        # What ``ckptd restore`` wrote, still as written, is complete without a quiet
        # window: ckptd wrote those files itself (a fresh node resumes from its restore).
        if verdict.complete or restored_as(watch_dir, listing) is not None:
            complete.append((rank, listing))
        elif verdict.recheck_after is not None:
            waiting.append((rank, verdict.recheck_after, listing))
    best: tuple[tuple[int, int, int], LocalCheckpoint] | None = None
    for rank, listing in sorted(complete, key=lambda c: c[0], reverse=True):
        if on_line is None or on_line(listing):
            best = (rank, LocalCheckpoint(watch_dir / listing.name, step_of(listing.name)))
            break
    newer = [
        after
        for rank, after, listing in waiting
        if (best is None or rank > best[0]) and (on_line is None or on_line(listing))
    ]
    return ResumePoint(best[1] if best else None, min(newer) if newer else None)
