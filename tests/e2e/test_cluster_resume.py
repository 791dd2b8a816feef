"""Lossless across nodes: a 2-node x 2-rank FSDP2 run (gloo, DCP saves on node-local disks)
is interrupted twice and ends bit-identical to an uninterrupted run.

1. A spot notice on node 1 only (the loopback IMDS fake that node 1's daemon polls). The
   ranks agree on one save step (all-reduce of the preempted flag), every rank saves it,
   both daemons ship their parts, one commits. Then both nodes are gone.
2. Two fresh directories each get the whole checkpoint (``ckptd restore --latest``), the
   run resumes, and at a random step between saves trainers and daemons on both nodes get
   ``kill -9``, both disks wiped: the steps since the last committed save are lost
   (fewer than the save interval), nothing else.
3. Restored again onto fresh directories, the run finishes; its weights equal the
   reference's bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from tests.support.cluster import (
    Cluster,
    Store,
    check_committed,
    compare_weights,
    dcp_trainer,
    restore_latest,
)
from tests.support.daemon import wait_until
from tests.support.fakes.aws_imds import FakeAwsImds

SEED = 20261203
MAX_STEPS = 30
SAVE_EVERY = 5
STEP_DELAY = 0.05  # stands in for compute, so a notice lands mid-interval


def between_saves(rng: random.Random, after: int) -> int:
    """A step past the next save after ``after``, never a save step itself."""
    step = (after // SAVE_EVERY + 1) * SAVE_EVERY + rng.randint(1, SAVE_EVERY - 1)
    assert step % SAVE_EVERY and step < MAX_STEPS - SAVE_EVERY, step
    return step


def fresh_cluster(
    work: Path, dest: str, endpoint: str, imds: dict[int, str], restore: bool
) -> tuple[Cluster, str | None]:
    cluster = Cluster(work, 2, dest, endpoint, imds_urls=imds, trainer_match=True)
    restored = None
    if restore:
        names = {
            restore_latest(dest, endpoint, node.run_dir, node.root / "restore")
            for node in cluster.members
        }
        assert len(names) == 1, names
        restored = names.pop()
    return cluster, restored


def test_a_two_node_run_preempted_then_killed_resumes_bit_identical(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, s3_client: Any, s3_prefix: str
) -> None:
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    store = Store(s3_client, s3_prefix)
    endpoint = local_s3.endpoint_url

    reference = dcp_trainer(
        tmp_path / "reference",
        [tmp_path / "reference" / "node-0", tmp_path / "reference" / "node-1"],
        max_steps=MAX_STEPS,
        save_every=SAVE_EVERY,
    )
    try:
        assert {r["step"] for r in reference.wait_exit(180)} == {MAX_STEPS}
    finally:
        reference.kill9()

    imds = FakeAwsImds()
    imds_url = imds.start_in_thread()
    try:
        # 1. Notice on node 1 only.
        cluster, _ = fresh_cluster(tmp_path / "seg-0", s3_dest, endpoint, {1: imds_url}, False)
        with cluster:
            cluster.start()
            trainer = dcp_trainer(
                tmp_path / "seg-0" / "trainer",
                [n.run_dir for n in cluster.members],
                max_steps=MAX_STEPS,
                save_every=SAVE_EVERY,
                step_delay=STEP_DELAY,
            )
            try:
                notice_at = between_saves(rng, 0)
                trainer.wait_step(notice_at, 120)
                imds.trigger_spot("terminate")
                results = trainer.wait_exit(60)
            finally:
                trainer.kill9()
            assert all(r["preempted"] for r in results), results
            steps = {r["step"] for r in results}
            saved = {r["saved"] for r in results}
            assert len(steps) == 1 and saved == {f"step-{steps.pop()}"}, results
            emergency = saved.pop()
            wait_until(
                lambda: store.manifest(emergency),
                60,
                f"commit of {emergency}",
                details=cluster.logs,
            )
            check_committed(store, emergency, cluster.local_files(emergency), nodes=2)
            # Node 0 never polled the IMDS: it heard of the notice through the store.
            notice = cluster[0].run_dir / ".ckptd" / "preemption.json"
            wait_until(notice.is_file, 10, "node 0's daemon following node 1's notice")
            cluster.kill9()
            cluster.wipe()
        imds.clear_spot()
        print(f"  notice on node 1 at step >= {notice_at}: every rank saved {emergency}")

        # 2. Resume on fresh nodes; kill -9 everything between saves; wipe both disks.
        cluster, restored = fresh_cluster(tmp_path / "seg-1", s3_dest, endpoint, {}, True)
        assert restored == emergency
        restored_step = int(emergency.split("-")[1])
        with cluster:
            kill_at = between_saves(rng, restored_step)
            newest = f"step-{kill_at - kill_at % SAVE_EVERY}"
            cluster.start()
            trainer = dcp_trainer(
                tmp_path / "seg-1" / "trainer",
                [n.run_dir for n in cluster.members],
                max_steps=MAX_STEPS,
                save_every=SAVE_EVERY,
                step_delay=STEP_DELAY,
                resume=[n.run_dir / emergency for n in cluster.members],
                hang_at=kill_at,
            )
            try:
                assert trainer.wait_step(kill_at, 120) == kill_at
                assert trainer.resumed_from() == {restored_step}
                wait_until(
                    lambda: store.manifest(newest), 60, f"commit of {newest}", details=cluster.logs
                )
            finally:
                trainer.kill9()
            cluster.kill9()
            cluster.wipe()
        print(f"  kill -9 of both nodes at step {kill_at}; newest committed {newest}")

        # 3. Restore again and finish.
        cluster, restored = fresh_cluster(tmp_path / "seg-2", s3_dest, endpoint, {}, True)
        assert restored == newest
        lost = kill_at - int(newest.split("-")[1])
        assert 0 < lost < SAVE_EVERY
        with cluster:
            cluster.start()
            trainer = dcp_trainer(
                tmp_path / "seg-2" / "trainer",
                [n.run_dir for n in cluster.members],
                max_steps=MAX_STEPS,
                save_every=SAVE_EVERY,
                resume=[n.run_dir / newest for n in cluster.members],
            )
            try:
                assert {r["step"] for r in trainer.wait_exit(120)} == {MAX_STEPS}
            finally:
                trainer.kill9()
            assert trainer.resumed_from() == {int(newest.split("-")[1])}
    finally:
        imds.stop_thread()

    mismatched = compare_weights(reference.final, trainer.final)
    assert not mismatched, f"final weights differ from the uninterrupted run: {mismatched}"
