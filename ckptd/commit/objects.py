"""The commit protocol's own objects in the store: many nodes' announcements and parts.

Their keys are spelled by ``ckptd.repository``; their formats are ``ckptd.commit.parts``'s.
A read never mistakes garbage for a protocol object: an announcement or part that does not
parse reads as absent (the next writer overwrites it, and it commits nothing meanwhile).
Blocking; run these in a thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ckptd.commit.parts import Announcement, Part, parse_announcement, parse_part
from ckptd.core.manifest import ManifestError
from ckptd.repository import LIST_CONCURRENCY, Repository, announce_key, part_key


def read_announcement(repo: Repository, run_id: str, checkpoint: str) -> Announcement | None:
    """The checkpoint's announcement, or None if absent or unreadable."""
    body = repo.get_or_none(announce_key(run_id, checkpoint))
    if body is None:
        return None
    try:
        return parse_announcement(body)
    except ManifestError:
        return None


def write_announcement(repo: Repository, announcement: Announcement) -> None:
    repo.put_json(
        announce_key(announcement.run_id, announcement.checkpoint), announcement.to_bytes()
    )


def write_part(repo: Repository, part: Part, slot: str | None = None) -> None:
    """One node's part, in the save's slot (``slot``; absent: the checkpoint's name)."""
    where = slot or part.checkpoint
    repo.put_json(part_key(part.run_id, where, part.node_rank), part.to_bytes())


def read_part(repo: Repository, run_id: str, checkpoint: str, rank: int) -> Part | None:
    """One node's part in slot ``checkpoint``, or None if absent or unreadable."""
    body = repo.get_or_none(part_key(run_id, checkpoint, rank))
    if body is None:
        return None
    try:
        return parse_part(body)
    except ManifestError:
        return None


def read_parts(
    repo: Repository, run_id: str, checkpoint: str, ranks: list[int] | None = None
) -> dict[int, Part]:
    """Every readable part of a checkpoint by rank (of ``ranks``, else of one listing);
    a part that does not parse, or names another rank than its key, is left out. Read
    ``LIST_CONCURRENCY`` at a time: a commit of many nodes waits on all of them."""
    todo = repo.part_ranks(run_id, checkpoint) if ranks is None else list(ranks)
    with ThreadPoolExecutor(max_workers=LIST_CONCURRENCY) as pool:
        read = list(pool.map(lambda rank: read_part(repo, run_id, checkpoint, rank), todo))
    return {
        rank: part
        for rank, part in zip(todo, read, strict=True)
        if part is not None and part.node_rank == rank
    }
