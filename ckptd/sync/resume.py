"""Which local checkpoint a (re)started trainer resumes from: the newest complete one.

"Complete" is the run's own completion rule (``ckptd.layouts``), the same verdict that
decides what is shipped (or a checkpoint ``ckptd restore`` wrote and nothing changed since:
``ckptd.sync.lineage.restored_as``, no quiet window), so a trainer never resumes from a checkpoint the daemon would
refuse to commit (a DCP save without ``.metadata``, an HF save without
``trainer_state.json``). "Newest" is the highest step (the name's last run of digits);
among names without a step, or equal steps, the newest file wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptd import layouts
from ckptd.layouts.base import RuleSettings, step_of
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
    watch_dir: Path, layout: str, rules: RuleSettings, now_ns: int
) -> ResumePoint:
    """Look at every checkpoint under ``watch_dir`` now (blocking I/O: run it off the loop)."""
    best: tuple[tuple[int, int, int], LocalCheckpoint] | None = None
    waiting: list[tuple[tuple[int, int, int], float]] = []
    for name in list_candidates(watch_dir):
        listing = snapshot(watch_dir, name)
        if listing is None:
            continue
        verdict = layouts.evaluate(layout, listing, now_ns, rules)
        rank = _rank(step_of(name), listing.newest_mtime_ns)
        # What ``ckptd restore`` wrote, still as written, is complete without a quiet
        # window: ckptd wrote those files itself (a fresh node resumes from its restore).
        if verdict.complete or restored_as(watch_dir, listing) is not None:
            if best is None or rank > best[0]:
                best = (rank, LocalCheckpoint(watch_dir / name, step_of(name)))
        elif verdict.recheck_after is not None:
            waiting.append((rank, verdict.recheck_after))
    newer = [after for rank, after in waiting if best is None or rank > best[0]]
    return ResumePoint(best[1] if best else None, min(newer) if newer else None)
