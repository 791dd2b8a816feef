"""Many nodes, one checkpoint, in-process: two nodes (own watch dir, own journal, own
pipeline, own store client) ship their parts of each checkpoint to one store (SeaweedFS
on loopback, and a directory), and exactly the union is committed, once.

Each node is driven by hand (rescan, look at the store, ship what is ready) in a loop
with a deadline, so "node 1's daemon is stopped" is simply a node not driven."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rich.console import Console

from ckptd.cli.statusview import render_status
from ckptd.commit import objects
from ckptd.commit import parts as cluster
from ckptd.commit.assemble import Assembly, Committer, try_commit
from ckptd.commit.single import commit
from ckptd.config import load_settings
from ckptd.core import checksum
from ckptd.core.manifest import build_manifest
from ckptd.core.names import rank_of_part
from ckptd.repository import Repository, announce_key, manifest_key, object_key, part_key
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_storage
from ckptd.storage.base import NotFoundError, Storage
from ckptd.store.restore import RestoreError, RestoreRequest, restore
from ckptd.store.retention import apply_retention
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline
from tests.support.writers import local_files, write_bytes

RUN = "run"
KiB = 1024


@pytest.fixture(params=["s3", "file"])
def dest(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """``(destination url, endpoint url)``: SeaweedFS, then a shared directory."""
    if request.param == "s3":
        local_s3 = request.getfixturevalue("local_s3")
        return request.getfixturevalue("s3_dest"), local_s3.endpoint_url
    return f"file://{tmp_path / 'shared'}", ""


class Node:
    """One node: its checkpoint dir, state dir and pipeline (the daemon's sync half)."""

    def __init__(self, tmp: Path, rank: int, dest: tuple[str, str], nodes: int = 2) -> None:
        self.rank = rank
        self.root = tmp / f"node-{rank}"
        self.watch = self.root / "run"
        self.watch.mkdir(parents=True, exist_ok=True)
        self.dest = dest
        self.settings = load_settings(
            overrides={
                "watch": [
                    {
                        "dir": str(self.watch),
                        "run_id": RUN,
                        "settle_seconds": 0.2,
                        "quiescence_seconds": 0.5,
                    }
                ],
                "destination": {"url": dest[0], "endpoint_url": dest[1], "concurrency": 2},
                "state": {"dir": str(self.root / "state")},
                "retention": {"keep_last": 0},
                "cluster": {"nodes": nodes, "node_rank": rank, "poll_interval_seconds": 0.1},
            },
            environ={},
        )
        self.pipeline: SyncPipeline | None = None

    def storage(self) -> Storage:
        return open_storage(self.dest[0], endpoint_url=self.dest[1] or None)

    async def start(self) -> SyncPipeline:
        journal = Journal(self.root / "state")
        self.pipeline = SyncPipeline(self.settings, self.storage(), journal, Metrics())
        await self.pipeline.recover()
        return self.pipeline

    async def step(self) -> None:
        """What the daemon's loops do in one turn: rescan, look at the store, ship."""
        p = self.pipeline
        assert p is not None
        await p.rescan(RUN)
        await p.poll_cluster()
        await asyncio.sleep(0.05)  # let hinted evaluations run
        await p.drain_once()

    async def stop(self) -> None:
        if self.pipeline is not None:
            await self.pipeline.close()
            self.pipeline.journal.close()
            self.pipeline = None

    def metric(self, name: str) -> float | None:
        assert self.pipeline is not None
        return self.pipeline.metrics.registry.get_sample_value(name, {"run": RUN})

    def status(self) -> dict[str, object]:
        assert self.pipeline is not None
        run: dict[str, object] = self.pipeline.status()["runs"][RUN]
        return run


async def drive(nodes: list[Node], until: Callable[[], bool], *, timeout: float = 30) -> None:
    """Turn every node until ``until()`` holds; fails at the deadline."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout}s")
        for node in nodes:
            await node.step()


async def drive_for(nodes: list[Node], seconds: float) -> None:
    """Turn the nodes for a while (to show something does *not* happen)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for node in nodes:
            await node.step()


@pytest.fixture
async def pair(
    tmp_path: Path, dest: tuple[str, str]
) -> AsyncIterator[tuple[Node, Node, Repository]]:
    nodes = (Node(tmp_path, 0, dest), Node(tmp_path, 1, dest))
    yield nodes[0], nodes[1], Repository(nodes[0].storage())
    for node in nodes:
        await node.stop()


def age(path: Path, seconds: float = 5.0) -> None:
    """Make every file under ``path`` look ``seconds`` old (past any quiet window)."""
    then = time.time() - seconds
    for f in path.rglob("*"):
        if f.is_file():
            os.utime(f, (then, then))


# -- shapes: each node's files, in the framework's order; the commit record on node 0 ----


def dcp_save(n0: Node, n1: Node, name: str = "step-10", size: int = 64 * KiB) -> None:
    """torch DCP on node-local disks: every rank's shard on its node, then (after the
    coordinator's gather) ``.metadata`` on node 0 only."""
    for node, ranks in ((n0, (0, 1)), (n1, (2, 3))):
        for r in ranks:
            write_bytes(node.watch / name / f"__{r}_0.distcp", size + r)
    write_bytes(n0.watch / name / ".metadata", 3000)


def deepspeed_save(n0: Node, n1: Node) -> str:
    name = "global_step10"
    for node, ranks in ((n0, (0, 1)), (n1, (2, 3))):
        for r in ranks:
            write_bytes(
                node.watch / name / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", 9000 + r
            )
    write_bytes(n0.watch / name / "mp_rank_00_model_states.pt", 5000)
    (n0.watch / "latest").write_text(name)
    return name


def megatron_save(n0: Node, n1: Node) -> str:
    name = "iter_0000010"
    for node, ranks in ((n0, (0, 1)), (n1, (2, 3))):
        for r in ranks:
            write_bytes(node.watch / name / f"mp_rank_0{r}" / "model_optim_rng.pt", 7000 + r)
    (n0.watch / "latest_checkpointed_iteration.txt").write_text("10")
    return name


def hf_save(n0: Node, n1: Node) -> str:
    name = "checkpoint-10"
    for node, ranks in ((n0, (0, 1)), (n1, (2, 3))):
        for r in ranks:
            write_bytes(node.watch / name / "pytorch_model_fsdp_0" / f"__{r}_0.distcp", 6000 + r)
            write_bytes(node.watch / name / f"rng_state_{r}.pth", 1400 + r)
    (n0.watch / name / "config.json").write_text('{"model_type": "gpt2"}')
    (n0.watch / name / "trainer_state.json").write_text('{"global_step": 10}')
    return name


def union(n0: Node, n1: Node, name: str) -> dict[str, bytes]:
    files = local_files(n0.watch / name)
    for path, data in local_files(n1.watch / name).items():
        assert files.setdefault(path, data) == data
    return files


def assert_committed_whole(repo: Repository, name: str, expected: dict[str, bytes]) -> None:
    """The global manifest lists exactly the union; every object is byte-identical and
    its CRC-32C, read back from the store, is the manifest's."""
    manifest = repo.read_manifest(RUN, name)
    assert manifest is not None, f"{name} not committed"
    assert manifest.nodes == 2 and manifest.save
    assert sorted(f.path for f in manifest.files) == sorted(expected)
    with ThreadPoolExecutor(2) as pool:
        for f in manifest.files:
            key = object_key(RUN, name, f.path)
            assert repo.storage.get_bytes(key) == expected[f.path], f.path
            assert checksum.to_hex(repo.crc_of_object(key, f.size, pool)) == f.crc32c
    latest = repo.read_latest(RUN)
    assert latest is not None and latest.checkpoint == name


# -- tests -------------------------------------------------------------------------------


async def test_dcp_checkpoint_commits_whole_only_once_every_node_has_shipped(
    pair: tuple[Node, Node, Repository], tmp_path: Path
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1)
    age(n0.root)
    age(n1.root)
    await n0.start()
    # Node 1's daemon is stopped: node 0 announces, ships its part, and waits.
    await drive([n0], lambda: bool(n0.status()["waiting"]))
    await drive_for([n0], 0.5)
    assert repo.read_manifest(RUN, "step-10") is None
    assert repo.list_committed(RUN) == []
    with pytest.raises(NotFoundError):
        repo.resolve(RUN, None)  # --latest sees only global manifests
    waiting = n0.status()["waiting"]
    assert isinstance(waiting, list) and len(waiting) == 1
    assert waiting[0]["checkpoint"] == "step-10" and waiting[0]["missing_nodes"] == [1]
    assert waiting[0]["since"].endswith("Z")
    assert n0.metric("ckptd_checkpoints_waiting_for_nodes") == 1
    announcement = objects.read_announcement(repo, RUN, "step-10")
    assert announcement is not None and announcement.node_rank == 0
    assert repo.part_ranks(RUN, "step-10") == [0]

    # Node 1 starts: it finds the announcement, ships its shards, and the union commits.
    await n1.start()
    await drive([n0, n1], lambda: repo.read_manifest(RUN, "step-10") is not None)
    expected = union(n0, n1, "step-10")
    assert ".metadata" in expected and "__3_0.distcp" in expected
    assert_committed_whole(repo, "step-10", expected)
    await drive([n0, n1], lambda: not n0.status()["waiting"] and not n1.status()["waiting"])
    assert n0.metric("ckptd_checkpoints_waiting_for_nodes") == 0
    committed = repo.list_committed(RUN)
    assert [c.manifest.checkpoint for c in committed] == ["step-10"]
    assert repo.list_names(RUN) == ["step-10"]

    # Restore: the whole checkpoint by default, one node's part on request.
    whole = restore(
        repo.storage, RestoreRequest(RUN, None, tmp_path / "restore-all", progress=False)
    )
    assert local_files(whole.path) == expected
    part = restore(
        repo.storage, RestoreRequest(RUN, "step-10", tmp_path / "restore-1", progress=False, part=1)
    )
    assert local_files(part.path) == local_files(n1.watch / "step-10")
    with pytest.raises(RestoreError, match="no part"):
        restore(
            repo.storage,
            RestoreRequest(RUN, "step-10", tmp_path / "restore-7", progress=False, part=7),
        )


async def test_a_save_one_node_took_after_a_non_finite_loss_commits_whole_and_suspect(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1)
    age(n0.root)
    age(n1.root)
    p0, p1 = await n0.start(), await n1.start()

    async def nan_on_node_1(run: str, step: int | None) -> str | None:
        return f"a non-finite loss at step {step}"

    p1.shipper.suspect_of = nan_on_node_1  # as the daemon's loss watch on node 1 would say
    assert p0.shipper.suspect_of is None
    await drive([n0, n1], lambda: repo.read_manifest(RUN, "step-10") is not None)
    assert_committed_whole(repo, "step-10", union(n0, n1, "step-10"))
    manifest = repo.read_manifest(RUN, "step-10")
    assert manifest is not None and manifest.suspect == "node 1: a non-finite loss at step 10"


@pytest.mark.parametrize("shape", [deepspeed_save, megatron_save, hf_save])
async def test_each_frameworks_shape_commits_both_nodes_files(
    pair: tuple[Node, Node, Repository], shape: Callable[[Node, Node], str]
) -> None:
    n0, n1, repo = pair
    name = shape(n0, n1)
    age(n0.root)
    age(n1.root)
    await n0.start()
    await n1.start()
    await drive([n1, n0], lambda: repo.read_manifest(RUN, name) is not None)
    assert_committed_whole(repo, name, union(n0, n1, name))
    manifest = repo.read_manifest(RUN, name)
    assert manifest is not None and manifest.layout == shape.__name__.split("_")[0]


async def test_a_part_of_an_older_save_is_never_merged(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1)
    age(n0.root)
    age(n1.root)
    # Left over from an earlier save under the same name: node 1's part, another save.
    stale = cluster.Part(
        run_id=RUN,
        checkpoint="step-10",
        node_rank=1,
        nodes=2,
        save="00000bad",
        layout="dcp",
        step=10,
        host="old",
        created_at="2026-01-01T00:00:00Z",
        verified_at="2026-01-01T00:00:00Z",
        total_bytes=1,
        files=cluster.part_files([("__2_0.distcp", 1, "00000001")]),
    )
    objects.write_part(repo, stale)
    await n0.start()
    await drive([n0], lambda: bool(n0.status()["waiting"]))
    await drive_for([n0], 0.5)
    assert repo.read_manifest(RUN, "step-10") is None
    waiting = n0.status()["waiting"]
    assert isinstance(waiting, list)
    assert waiting[0]["missing_nodes"] == [1] and "another save" in waiting[0]["reason"]
    await n1.start()
    await drive([n0, n1], lambda: repo.read_manifest(RUN, "step-10") is not None)
    assert_committed_whole(repo, "step-10", union(n0, n1, "step-10"))
    part = objects.read_part(repo, RUN, "step-10", 1)
    assert part is not None and part.save != "00000bad"


async def test_a_resave_under_the_same_name_never_mixes_parts(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1, size=40 * KiB)
    age(n0.root, 60)
    age(n1.root, 60)
    await n0.start()
    await drive([n0], lambda: bool(n0.status()["waiting"]))
    first = objects.read_announcement(repo, RUN, "step-10")
    assert first is not None and repo.part_ranks(RUN, "step-10") == [0]
    # The trainer restarts and saves step-10 again, other bytes: every rank's shards
    # first (the old .metadata still beside them, as DCP leaves it until finish()).
    for node, ranks in ((n0, (0, 1)), (n1, (2, 3))):
        for r in ranks:
            write_bytes(node.watch / "step-10" / f"__{r}_0.distcp", 50 * KiB + r)
    # Node 0 sees its files change: it withdraws the old save's announcement and part,
    # so node 1 can never pair its new shards with the old save.
    await drive([n0], lambda: objects.read_announcement(repo, RUN, "step-10") is None)
    assert repo.part_ranks(RUN, "step-10") == []
    await n1.start()
    await drive_for([n0, n1], 0.6)
    assert repo.read_manifest(RUN, "step-10") is None
    assert repo.part_ranks(RUN, "step-10") == []  # node 1 waits for the new announcement
    write_bytes(n0.watch / "step-10" / ".metadata", 3100)  # finish(): the new save commits
    await drive([n0, n1], lambda: repo.read_manifest(RUN, "step-10") is not None)
    expected = union(n0, n1, "step-10")
    assert all(len(v) >= 50 * KiB for k, v in expected.items() if k.endswith(".distcp"))
    assert_committed_whole(repo, "step-10", expected)
    manifest = repo.read_manifest(RUN, "step-10")
    assert manifest is not None and manifest.save != first.save


async def test_a_node_restarted_during_a_resave_withdraws_its_old_announcement(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1, size=40 * KiB)
    age(n0.root, 60)
    await n0.start()
    await drive([n0], lambda: bool(n0.status()["waiting"]))
    await n0.stop()
    for r in (0, 1):  # the re-save begins while node 0's daemon is down
        write_bytes(n0.watch / "step-10" / f"__{r}_0.distcp", 50 * KiB + r)
    await n0.start()
    await drive([n0], lambda: objects.read_announcement(repo, RUN, "step-10") is None)
    assert repo.part_ranks(RUN, "step-10") == []


async def test_a_conflicting_file_is_never_committed_and_is_counted(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1)
    (n0.watch / "step-10" / "extra.json").write_text('{"node": 0}')
    (n1.watch / "step-10" / "extra.json").write_text('{"node": 1}')
    age(n0.root)
    age(n1.root)
    await n0.start()
    await n1.start()
    await drive(
        [n0, n1],
        lambda: (
            (n0.metric("ckptd_cluster_conflicts_total") or 0)
            + (n1.metric("ckptd_cluster_conflicts_total") or 0)
            >= 1
        ),
    )
    await drive_for([n0, n1], 0.5)
    assert repo.read_manifest(RUN, "step-10") is None
    failed = [n.status()["failed"] for n in (n0, n1)]
    assert any("extra.json" in str(f) for f in failed)


async def test_a_node_restarted_after_its_part_rewrites_it_without_sending_again(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1)
    age(n0.root)
    age(n1.root)
    await n1.start()
    await n0.start()
    await drive([n0], lambda: bool(n0.status()["waiting"]))
    await n0.stop()
    repo.delete([part_key(RUN, "step-10", 0)])  # lost, or killed before the put landed
    restarted = await n0.start()
    # Both converge: the commit (by whichever node gets there) and node 0 knowing it.
    await drive([n0, n1], lambda: restarted.journal.is_committed(RUN, "step-10"))
    assert_committed_whole(repo, "step-10", union(n0, n1, "step-10"))
    assert (n0.metric("ckptd_upload_bytes_total") or 0) == 0  # the journal had every object
    part = objects.read_part(repo, RUN, "step-10", 0)
    assert part is not None and part.save == repo.read_manifest(RUN, "step-10").save  # type: ignore[union-attr]


async def test_retention_sweeps_announcements_and_parts_that_can_never_commit(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1, name="step-5")
    shutil.rmtree(n1.watch / "step-5")  # node 1 lost its disk: step-5 never completes
    age(n0.root)
    await n0.start()
    await drive([n0], lambda: bool(n0.status()["waiting"]))
    dcp_save(n0, n1, name="step-10")
    age(n0.watch / "step-10")
    age(n1.watch / "step-10")
    await n1.start()
    await drive([n0, n1], lambda: repo.read_manifest(RUN, "step-10") is not None)
    assert repo.storage.head(announce_key(RUN, "step-5")) is not None
    # Within the grace period nothing goes; past it, step-5's announcement and part do.
    apply_retention(repo, RUN, keep_last=0, keep_every_steps=0, cluster_grace_seconds=3600)
    assert repo.cluster_keys(RUN, "step-5")
    later = time.time() + 7200
    apply_retention(
        repo, RUN, keep_last=0, keep_every_steps=0, cluster_grace_seconds=3600, now=later
    )
    assert repo.cluster_keys(RUN, "step-5") == []
    assert repo.read_manifest(RUN, "step-10") is not None
    assert repo.cluster_keys(RUN, "step-10")  # a committed checkpoint keeps its parts
    # Node 0, finding its part of step-5 gone and step-10 committed, gives step-5 up:
    # no longer waiting, never announced again.
    await drive([n0], lambda: not n0.status()["waiting"])
    assert "superseded" in str(n0.status()["failed"])
    assert n0.metric("ckptd_checkpoints_waiting_for_nodes") == 0
    await drive_for([n0], 0.3)
    assert repo.cluster_keys(RUN, "step-5") == []


async def test_a_waiting_checkpoint_below_a_newer_commit_is_given_up_after_the_grace(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1, name="step-5")
    shutil.rmtree(n1.watch / "step-5")
    dcp_save(n0, n1, name="step-10")
    age(n0.root)
    age(n1.root)
    await n0.start()
    await n1.start()
    await drive([n0, n1], lambda: repo.read_manifest(RUN, "step-10") is not None)
    await drive_for([n0, n1], 0.3)
    assert [w["checkpoint"] for w in n0.status()["waiting"]] == ["step-5"]  # type: ignore[attr-defined]
    assert n0.pipeline is not None
    n0.pipeline.cluster.abandon_grace_seconds = 0.2
    await drive([n0], lambda: not n0.status()["waiting"])
    assert "superseded" in str(n0.status()["failed"])
    assert repo.read_manifest(RUN, "step-5") is None


class PartReads(Repository):
    """The store as it is, counting the parts read."""

    parts_read = 0

    def get_or_none(self, key: str) -> bytes | None:
        if rank_of_part(key.rsplit("/", 1)[-1]) is not None:
            self.parts_read += 1
        return super().get_or_none(key)


async def test_a_node_that_only_polls_leaves_reading_the_parts_to_node_0(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    dcp_save(n0, n1)
    age(n0.root)
    age(n1.root)
    await n0.start()
    await n1.start()
    await drive([n0, n1], lambda: repo.read_manifest(RUN, "step-10") is not None)
    # As if the node whose part completed the set died before its commit: every part is
    # listed and there is no manifest. Node 1, polling, reads no part (N nodes reading
    # N parts each was the commit's cost at 64 nodes); told to assemble, it commits.
    repo.storage.delete([manifest_key(RUN, "step-10")])
    counting = PartReads(repo.storage)
    node1 = Committer(nodes=2, rank=1, host="n1")
    result = try_commit(counting, RUN, "step-10", node1, save=None, now=time.time(), assemble=False)
    assert result.outcome is Assembly.WAITING and result.missing == ()
    assert counting.parts_read == 0 and repo.read_manifest(RUN, "step-10") is None
    result = try_commit(counting, RUN, "step-10", node1, save=None, now=time.time())
    assert result.outcome is Assembly.COMMITTED and counting.parts_read == 2


def test_status_view_shows_waiting_checkpoints() -> None:

    doc = {
        "runs": {
            RUN: {
                "pending": [],
                "uploading": None,
                "last_committed": None,
                "sync_lag_seconds": 0,
                "waiting": [
                    {
                        "checkpoint": "step-10",
                        "missing_nodes": [1, 3],
                        "since": "2026-12-03T12:00:00Z",
                    }
                ],
            }
        }
    }
    out = io.StringIO()
    render_status(doc, Console(file=out, width=120, color_system=None))
    assert "waiting: run/step-10 for node(s) 1, 3" in out.getvalue()


def test_announcement_and_parts_are_never_taken_for_checkpoints_or_files(
    tmp_path: Path,
) -> None:
    storage = open_storage(f"file://{tmp_path / 'store'}")
    repo = Repository(storage)
    body = b"x"
    for key in (announce_key(RUN, "step-1"), part_key(RUN, "step-1", 0), f"{RUN}/NOTICE"):
        storage.put_bytes(key, body, crc32c=checksum.crc32c(body))
    assert repo.list_committed(RUN) == []
    assert objects.read_announcement(repo, RUN, "step-1") is None  # unreadable: none
    assert objects.read_parts(repo, RUN, "step-1") == {}
    with pytest.raises(NotFoundError):
        repo.resolve(RUN, None)
    assert repo.list_names(RUN) == ["step-1"]  # a name, but never a committed checkpoint
    # With a committed manifest beside them, the checkpoint's files are the manifest's only.
    data = write_bytes(tmp_path / "w" / "a.bin", 10)
    storage.put_bytes(object_key(RUN, "step-1", "a.bin"), data, crc32c=checksum.crc32c(data))
    manifest = build_manifest(
        run_id=RUN,
        checkpoint="step-1",
        step=1,
        layout="dcp",
        host="h",
        created_at=0.0,
        committed_at=0.0,
        files=[("a.bin", 10, checksum.to_hex(checksum.crc32c(data)))],
        environment={},
        nodes=2,
        save="00000001",
    )
    commit(repo, manifest)
    restored = restore(storage, RestoreRequest(RUN, None, tmp_path / "r", progress=False))
    assert sorted(local_files(restored.path)) == ["a.bin"]


async def test_a_followers_share_of_an_emergency_save_holds_the_flush_until_announced(
    pair: tuple[Node, Node, Repository],
) -> None:
    n0, n1, repo = pair
    p1 = await n1.start()
    p1.emergency.enter_emergency(None)  # a notice: the trainer saves at once, on both nodes
    dcp_save(n0, n1, name="step-20")
    # Node 1's shards are there, unannounced: the pipeline is idle, yet a SIGTERM flush
    # must not end (service._drain_after_sigterm waits on awaiting_emergency()).
    await drive([n1], lambda: p1.idle() and p1.awaiting_emergency())
    assert repo.read_manifest(RUN, "step-20") is None
    await n0.start()
    await drive(
        [n0, n1],
        lambda: repo.read_manifest(RUN, "step-20") is not None and not p1.awaiting_emergency(),
    )
    assert_committed_whole(repo, "step-20", union(n0, n1, "step-20"))
