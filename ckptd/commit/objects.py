"""The commit protocol's own objects in the store: many nodes' announcements and parts.

Their keys are spelled by ``ckptd.repository``; their formats are ``ckptd.commit.parts``'s.
A read never mistakes garbage for a protocol object: an announcement or part that does not
parse reads as absent (the next writer overwrites it, and it commits nothing meanwhile).
Blocking; run these in a thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from ckptd.commit.parts import Announcement, Part, parse_announcement, parse_part
from ckptd.core.manifest import ManifestError
from ckptd.repository import LIST_CONCURRENCY, Repository, announce_key, object_key, part_key
from ckptd.storage.base import ObjectInfo


def read_announcement(repo: Repository, run_id: str, slot: str) -> Announcement | None:
    """The announcement in ``slot``, or None if absent or unreadable. A save is announced
    in the slot its job ships into (``write_announcement``): the name's own for the job
    that holds the name's canonical slot, a private slot's for another job."""
    body = repo.get_or_none(announce_key(run_id, slot))
    if body is None:
        return None
    try:
        return parse_announcement(body)
    except ManifestError:
        return None


def write_announcement(repo: Repository, announcement: Announcement) -> None:
    """In the announced save's slot (``Announcement.slot_name``): two jobs of one run id
    saving one name are two writers with two slots, and never overwrite each other's
    announcement (``ckptd.sync.claims.cluster_writer``)."""
    repo.put_json(
        announce_key(announcement.run_id, announcement.slot_name), announcement.to_bytes()
    )


#: A part's identity for an object its node found was not its own write: matches no object.
NOT_OURS = "not-this-nodes-write"


def object_identity(info: ObjectInfo) -> str:
    """What tells one write of an object from another, as the store reports it: its ETag
    (S3, GCS: of its bytes), else its modification time (a directory); "" when the store
    says neither. Another write of other bytes at the key has another identity."""
    if info.etag:
        return "etag:" + info.etag.strip('"')
    if info.modified:
        return f"mtime:{info.modified!r}"
    return ""


def identities(
    repo: Repository, run_id: str, slot: str, paths: Iterable[str]
) -> dict[str, ObjectInfo | None]:
    """The store's report on each of ``paths`` in ``slot``: one listing, then a HEAD of each
    object the listing lacks or says no identity of (a directory's listing has no times).
    None: not there."""
    wanted = {object_key(run_id, slot, p): p for p in paths}
    found: dict[str, ObjectInfo | None] = dict.fromkeys(wanted.values())
    for info in repo.list_objects(run_id, slot):
        path = wanted.get(info.key)
        if path is not None:
            found[path] = info
    todo = [p for p, info in found.items() if info is None or not object_identity(info)]
    if todo:
        with ThreadPoolExecutor(max_workers=LIST_CONCURRENCY) as pool:
            heads = list(pool.map(lambda p: repo.storage.head(object_key(run_id, slot, p)), todo))
        found.update(zip(todo, heads, strict=True))
    return found


def not_as_written(
    repo: Repository,
    run_id: str,
    slot: str,
    files: Iterable[tuple[str, int]],
    written: Mapping[str, frozenset[str]],
) -> list[str]:
    """The paths whose object in ``slot`` is not the one its node wrote: gone, of another
    size, or (where the node's part recorded it, ``Part.objects``) of another identity
    (``object_identity``): another writer's bytes at the key. Empty: every object is the
    parts' own."""
    sizes = dict(files)
    found = identities(repo, run_id, slot, sizes)
    bad: list[str] = []
    for path, size in sizes.items():
        info = found[path]
        ids = written.get(path, frozenset())
        if info is None or info.size != size or (ids and object_identity(info) not in ids):
            bad.append(path)
    return bad


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
