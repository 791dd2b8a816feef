"""Two many-node jobs of one run id saving one name at once (issue 44, item 5): one
job's shards commit whole, the other job is a conflict on every one of its nodes, and the
committed manifest never lists another job's bytes.

Four nodes in-process (``test_cluster_sync.Node``: own watch dir, journal, pipeline and
store client each), two jobs of two nodes (``[cluster] job_id`` X and Y), one run id, a
DCP ``step-100`` of equal-size shards with different bytes on each job, on SeaweedFS and
on a shared directory. Every committed object is read back and compared with what each
job's nodes wrote."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd.commit import objects
from ckptd.commit.assemble import Assembly, Committer, announce, try_commit
from ckptd.commit.parts import Announcement, Part, part_files
from ckptd.config import load_settings
from ckptd.core import checksum
from ckptd.repository import Repository, object_key
from ckptd.store.restore import RestoreRequest, restore
from tests.integration.test_cluster_sync import RUN, Node, age, dcp_save, dest, drive, union
from tests.support.writers import local_files

__all__ = ["dest"]  # the store fixture, SeaweedFS then a directory

NAME = "step-100"
SHARD = 48 * 1024  # every shard of both jobs this size (``dcp_save`` adds the rank)


def job_node(tmp: Path, job: str, rank: int, store: tuple[str, str]) -> Node:
    """Node ``rank`` of job ``job``: ``test_cluster_sync.Node`` with ``cluster.job_id``."""
    node = Node(tmp / f"job-{job}", rank, store)
    overrides: dict[str, Any] = node.settings.model_dump(mode="json")
    overrides["cluster"]["job_id"] = job
    node.settings = load_settings(overrides=overrides, environ={})
    return node


def conflicted(node: Node) -> bool:
    """Whether ``node`` refused ``NAME`` as a conflict (said, and counted)."""
    assert node.pipeline is not None
    failed = node.pipeline.metrics.registry.get_sample_value(
        "ckptd_checkpoints_failed_total", {"run": RUN, "reason": "conflict"}
    )
    return NAME in node.status()["failed"] and (failed or 0) >= 1  # type: ignore[operator]


def assert_one_jobs_bytes(repo: Repository, jobs: dict[str, dict[str, bytes]]) -> str:
    """The committed manifest of ``NAME`` lists exactly one job's files, and every object
    read back is that job's bytes under that job's CRC-32C; returns the job."""
    manifest = repo.read_manifest(RUN, NAME, follow=True)
    assert manifest is not None and manifest.nodes == 2
    read = {
        f.path: repo.storage.get_bytes(object_key(RUN, manifest.checkpoint, f.path))
        for f in manifest.files
    }
    for f in manifest.files:
        assert checksum.to_hex(checksum.crc32c(read[f.path])) == f.crc32c, f.path
    winners = [job for job, files in jobs.items() if files == read]
    assert len(winners) == 1, "the committed objects are not one job's shards, whole"
    latest = repo.read_latest(RUN)
    assert latest is not None and latest.checkpoint == manifest.checkpoint
    return winners[0]


async def stop_all(nodes: list[Node]) -> None:
    for node in nodes:
        await node.stop()


async def drive_together(
    nodes: list[Node], until: Callable[[], bool], *, timeout: float = 40
) -> None:
    """``drive``, but every node's turn at once: the four daemons race in one loop."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"not reached in {timeout}s"
        await asyncio.gather(*(node.step() for node in nodes))


@pytest.mark.parametrize("order", ["together", "interleaved", "x-first", "beside-a-zombie"])
async def test_two_jobs_racing_on_one_name_commit_one_jobs_shards_whole(
    tmp_path: Path, dest: tuple[str, str], order: str
) -> None:
    """Both jobs save ``step-100`` within a second and every daemon runs: one job's save
    commits whole, every node of the other is refused as a conflict. ``together``: every
    daemon's turn at once; ``interleaved``: both jobs' node 0 announce and ship before
    either node 1 does; ``x-first``: one job's turns before the other's; and
    ``beside-a-zombie``: job X's node 1 is stopped (a zombie of the job, relaunched as Y)
    until Y has committed, then comes back: X is a conflict on both its nodes."""
    x0, x1 = job_node(tmp_path, "X", 0, dest), job_node(tmp_path, "X", 1, dest)
    y0, y1 = job_node(tmp_path, "Y", 0, dest), job_node(tmp_path, "Y", 1, dest)
    nodes = [x0, y0, x1, y1] if order == "interleaved" else [x0, x1, y0, y1]
    stuck = order == "beside-a-zombie"
    turn = drive_together if order == "together" else drive
    repo = Repository(x0.storage())
    try:
        dcp_save(x0, x1, NAME, SHARD)
        dcp_save(y0, y1, NAME, SHARD)
        jobs = {"X": union(x0, x1, NAME), "Y": union(y0, y1, NAME)}
        assert sorted(jobs["X"]) == sorted(jobs["Y"]) and jobs["X"] != jobs["Y"]
        assert all(len(jobs["X"][p]) == len(jobs["Y"][p]) for p in jobs["X"])
        for node in nodes:
            age(node.root)
            await node.start()
        running = [x0, y0, y1] if stuck else nodes
        await turn(
            running, lambda: repo.read_manifest(RUN, NAME, follow=True) is not None, timeout=40
        )
        running = nodes
        winner = assert_one_jobs_bytes(repo, jobs)
        if stuck:
            assert winner == "Y", "X cannot commit without its node 1"
        losers = [x0, x1] if winner == "Y" else [y0, y1]
        winners = [y0, y1] if winner == "Y" else [x0, x1]
        await turn(running, lambda: all(conflicted(n) for n in losers), timeout=40)
        await turn(running, lambda: all(not n.status()["waiting"] for n in winners))
        assert not any(conflicted(n) for n in winners)
        assert assert_one_jobs_bytes(repo, jobs) == winner  # nothing changed since
        assert [c.manifest.local_name for c in repo.list_committed(RUN)] == [NAME]

        # restore --latest: the winner's shards, whole, byte for byte.
        restored = restore(
            repo.storage, RestoreRequest(RUN, None, tmp_path / "restored", progress=False)
        )
        assert restored.step == 100
        assert local_files(restored.path) == jobs[winner]
    finally:
        await stop_all(nodes)


async def test_the_second_job_after_the_first_is_refused_on_every_node(
    tmp_path: Path, dest: tuple[str, str]
) -> None:
    """One after the other: job X commits ``step-100``; job Y, saving the same name with
    other bytes later, is a conflict on both its nodes and X's objects stay X's."""
    x0, x1 = job_node(tmp_path, "X", 0, dest), job_node(tmp_path, "X", 1, dest)
    y0, y1 = job_node(tmp_path, "Y", 0, dest), job_node(tmp_path, "Y", 1, dest)
    repo = Repository(x0.storage())
    try:
        dcp_save(x0, x1, NAME, SHARD)
        for node in (x0, x1):
            age(node.root)
            await node.start()
        await drive([x0, x1], lambda: repo.read_manifest(RUN, NAME) is not None)
        dcp_save(y0, y1, NAME, SHARD)
        for node in (y0, y1):
            age(node.root)
            await node.start()
        await drive([x0, x1, y0, y1], lambda: conflicted(y0) and conflicted(y1))
        jobs = {"X": union(x0, x1, NAME), "Y": union(y0, y1, NAME)}
        assert assert_one_jobs_bytes(repo, jobs) == "X"
    finally:
        await stop_all([x0, x1, y0, y1])


async def test_a_part_over_another_writers_bytes_is_never_committed(
    tmp_path: Path, dest: tuple[str, str]
) -> None:
    """The committer's own check, whatever the writers: both parts of a save are written
    over their nodes' objects, then one object is overwritten with other bytes of the
    same size (another writer sharing the slot: two jobs without a job id). The commit
    waits, naming the object; once the node ships its own bytes again and rewrites its
    part, the save commits, over its own bytes."""
    node = Node(tmp_path, 0, dest)
    repo = Repository(node.storage())
    files = {
        0: {"__0_0.distcp": b"a" * SHARD, ".metadata": b"m" * 300},
        1: {"__1_0.distcp": b"b" * SHARD},
    }
    announce(
        repo,
        Announcement(
            run_id=RUN,
            checkpoint=NAME,
            save="s1",
            node_rank=0,
            layout="dcp",
            step=100,
            announced_at="2026-01-01T00:00:00Z",
            writer="cluster-2",
        ),
    )

    def ship(rank: int) -> None:
        for path, data in files[rank].items():
            repo.storage.put_bytes(object_key(RUN, NAME, path), data, crc32c=checksum.crc32c(data))
        found = objects.identities(repo, RUN, NAME, files[rank])
        part = Part(
            run_id=RUN,
            checkpoint=NAME,
            node_rank=rank,
            nodes=2,
            save="s1",
            layout="dcp",
            step=100,
            host=f"h{rank}",
            created_at="2026-01-01T00:00:00Z",
            verified_at="2026-01-01T00:00:00Z",
            total_bytes=sum(map(len, files[rank].values())),
            files=part_files(
                [(p, len(d), checksum.to_hex(checksum.crc32c(d))) for p, d in files[rank].items()]
            ),
            objects={p: objects.object_identity(i) for p, i in found.items() if i is not None},
        )
        objects.write_part(repo, part)

    ship(0)
    ship(1)
    time.sleep(0.01)  # a directory's identity is its mtime: let the overwrite be later
    foreign = b"c" * SHARD
    key = object_key(RUN, NAME, "__1_0.distcp")
    repo.storage.put_bytes(key, foreign, crc32c=checksum.crc32c(foreign))
    committer = Committer(2, 0, "h0", writer="cluster-2")
    result = try_commit(repo, RUN, NAME, committer, save="s1", now=time.time())
    assert result.outcome is Assembly.WAITING and "__1_0.distcp" in result.reason
    assert repo.read_manifest(RUN, NAME) is None
    ship(1)
    result = try_commit(repo, RUN, NAME, committer, save="s1", now=time.time())
    assert result.outcome is Assembly.COMMITTED
    assert repo.storage.get_bytes(key) == files[1]["__1_0.distcp"]
