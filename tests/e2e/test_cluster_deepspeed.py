"""A real DeepSpeed ZeRO-2 run on CPU (gloo), 2 nodes x 2 ranks, saving into node-local
directories: each node's ``global_step<N>/`` holds its ranks' ``zero_pp_rank_*`` files, node 0
also rank 0's model states and the ``latest`` tag beside them. Both nodes' files are
committed as one checkpoint; restored whole onto fresh directories, the run resumes and
ends bit-identical to the uninterrupted one.

DeepSpeed is not a dependency of ckptd; the test runs where it is installed::

    DS_BUILD_OPS=0 .venv/bin/pip install deepspeed
    .venv/bin/pytest -q tests/e2e/test_cluster_deepspeed.py

(The first run JIT-builds DeepSpeed's CPU shared-memory op, about a minute and a half.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.support.cluster import (
    Cluster,
    Store,
    TrainerGroup,
    check_committed,
    compare_weights,
    restore_latest,
)
from tests.support.daemon import wait_until

pytest.importorskip("deepspeed")

MODULE = "tests.support.trainers.cluster_deepspeed"


def test_a_two_node_zero_checkpoint_is_committed_whole_and_resumes_bit_identical(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, s3_client: Any, s3_prefix: str
) -> None:
    store = Store(s3_client, s3_prefix)
    args = ["--steps", "6", "--save-every", "3"]
    with Cluster(tmp_path / "train", 2, s3_dest, local_s3.endpoint_url) as cluster:
        cluster.start()
        first = TrainerGroup(
            tmp_path / "first", [n.run_dir for n in cluster.members], args, module=MODULE
        )
        try:
            assert {r["step"] for r in first.wait_exit(300)} == {6}
        finally:
            first.kill9()
        assert (cluster[0].run_dir / "latest").read_text().strip() == "global_step6"
        assert not (cluster[1].run_dir / "latest").exists()
        for name in ("global_step3", "global_step6"):
            files = cluster.local_files(name)
            assert any(p.startswith("zero_pp_rank_2_") for p in files[1]), files
            assert "mp_rank_00_model_states.pt" in files[0]
            wait_until(lambda n=name: store.manifest(n), 60, name, details=cluster.logs)
            check_committed(store, name, files, nodes=2)

    # Fresh nodes get the whole of global_step3; ranks load their own and others' files.
    fresh = Cluster(tmp_path / "fresh", 2, s3_dest, local_s3.endpoint_url)
    for node in fresh.members:
        restore_latest(
            s3_dest, local_s3.endpoint_url, node.run_dir, node.root, checkpoint="global_step3"
        )
    resumed = TrainerGroup(
        tmp_path / "resumed",
        [n.run_dir for n in fresh.members],
        args,
        module=MODULE,
        resume=[n.run_dir / "global_step3" for n in fresh.members],
    )
    try:
        assert {r["step"] for r in resumed.wait_exit(300)} == {6}
    finally:
        resumed.kill9()
    assert not compare_weights(first.final, resumed.final)
