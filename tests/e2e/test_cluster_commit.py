"""Two nodes, one checkpoint: a real 2-node x 2-rank FSDP2 trainer over gloo saves with
DCP into node-local directories (``.metadata`` on node 0 only); one real daemon per node.

- Every shard of both nodes is committed, byte-identical, its CRC-32C read back.
- Nothing is committed while one node's daemon is stopped; the commit follows its start.
- ``ckptd restore --latest`` brings the whole checkpoint (both nodes' files) to a fresh node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from tests.support.cluster import Cluster, Store, check_committed, dcp_trainer, restore_latest
from tests.support.daemon import wait_until


def test_a_two_node_dcp_checkpoint_commits_only_with_every_shard_of_both_nodes(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, s3_client: Any, s3_prefix: str
) -> None:
    store = Store(s3_client, s3_prefix)
    with Cluster(tmp_path / "cluster", 2, s3_dest, local_s3.endpoint_url) as cluster:
        cluster.start(0)  # node 1's daemon is down
        trainer = dcp_trainer(
            tmp_path / "trainer",
            [cluster[0].run_dir, cluster[1].run_dir],
            max_steps=10,
            save_every=5,
        )
        try:
            results = trainer.wait_exit(120)
        finally:
            trainer.kill9()
        assert {r["saved"] for r in results} == {"step-10"}
        files = cluster.local_files("step-10")
        # The layout this test is about: node 1 holds shards and no commit record.
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files[0])
        assert {"__2_0.distcp", "__3_0.distcp"} <= set(files[1])
        assert ".metadata" not in files[1]

        # Node 0 announces and ships its part; without node 1's nothing commits.
        for name in ("step-5", "step-10"):
            wait_until(
                lambda n=name: store.part(n, 0) and store.announcement(n),
                60,
                f"node 0's part of {name}",
                details=cluster.logs,
            )
        part = store.part("step-10", 0)
        assert part is not None and part["node_rank"] == 0
        assert {f["path"] for f in part["files"]} == set(files[0])

        # The part object is written inside the ship, the status entry just after it:
        # poll until both checkpoints are reported rather than take the first look.
        def waiting() -> list[dict[str, Any]] | None:
            entries = cluster.daemon(0).get_json("/v1/status")["runs"]["run"].get("waiting")
            names = {w["checkpoint"] for w in entries or []}
            return entries if names == {"step-5", "step-10"} else None

        entries = wait_until(
            waiting,
            30,
            "node 0 reporting step-5 and step-10 waiting for node 1",
            details=cluster.logs,
        )
        assert all(w["missing_nodes"] == [1] for w in entries), entries
        assert cluster.daemon(0).metric("ckptd_checkpoints_waiting_for_nodes", run="run") == 2
        assert store.committed() == [] and store.latest() is None

        cluster.start(1)
        wait_until(
            lambda: store.committed() == ["step-10", "step-5"],
            60,
            "both checkpoints committed once node 1 is up",
            details=cluster.logs,
        )
        for name in ("step-5", "step-10"):
            manifest = check_committed(store, name, cluster.local_files(name), nodes=2)
            assert manifest["step"] == int(name.split("-")[1])
        latest = store.latest()
        assert latest is not None and latest["checkpoint"] == "step-10"
        wait_until(
            lambda: cluster.daemon(0).metric("ckptd_checkpoints_waiting_for_nodes", run="run") == 0,
            30,
            "node 0's waiting gauge back to 0",
        )

        # A fresh node gets the whole checkpoint: every rank's shard and rank file.
        fresh = tmp_path / "fresh"
        assert restore_latest(s3_dest, local_s3.endpoint_url, fresh / "run", fresh) == "step-10"
        restored = {
            p.relative_to(fresh / "run" / "step-10").as_posix(): p.read_bytes()
            for p in (fresh / "run" / "step-10").rglob("*")
            if p.is_file()
        }
        union = {rel: p.read_bytes() for f in files.values() for rel, p in f.items()}
        assert restored == union
