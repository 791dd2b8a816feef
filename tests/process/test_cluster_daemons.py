"""Many nodes with real daemons: two ``ckptd run`` processes (own dirs, state, ports),
one SeaweedFS store. Node 1's daemon starts late: until then ``/v1/status`` and
``/metrics`` on node 0 show the checkpoint waiting for node 1, and nothing is committed;
once it runs, the union is committed once, and ``ckptd restore --part`` fetches one
node's files. (In-process cases of every shape: tests/integration/test_cluster_sync.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, committed_manifest, run_cli, wait_until
from tests.support.writers import local_files, write_bytes


def node_daemon(tmp: Path, rank: int, dest: str, endpoint: str) -> tuple[Daemon, Path]:
    root = tmp / f"node-{rank}"
    watch = root / "run"
    watch.mkdir(parents=True)
    daemon = Daemon.configured(
        root,
        name=f"ckptd-{rank}",
        watch=[{"dir": watch, "run_id": "run", "settle_seconds": 0.2}],
        dest=dest,
        endpoint_url=endpoint,
        state_dir=root / "state",
    )
    daemon.env = {
        "CKPTD_CLUSTER__NODES": "2",
        "CKPTD_CLUSTER__NODE_RANK": str(rank),
        "CKPTD_CLUSTER__POLL_INTERVAL_SECONDS": "0.2",
    }
    return daemon, watch


def test_two_daemons_commit_one_dcp_checkpoint_and_node_1_is_awaited(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    d0, w0 = node_daemon(tmp_path, 0, s3_dest, local_s3.endpoint_url)
    d1, w1 = node_daemon(tmp_path, 1, s3_dest, local_s3.endpoint_url)
    # DCP's order: every rank's shard on its own node, then .metadata on node 0 only.
    for watch, ranks in ((w0, (0, 1)), (w1, (2, 3))):
        for r in ranks:
            write_bytes(watch / "step-10" / f"__{r}_0.distcp", 96 * 1024 + r)
    write_bytes(w0 / "step-10" / ".metadata", 2000)
    old = time.time() - 5
    for f in [*w0.rglob("*"), *w1.rglob("*")]:
        os.utime(f, (old, old))

    with d0:
        waiting = wait_until(
            lambda: d0.get_json("/v1/status")["runs"]["run"].get("waiting"),
            30,
            "node 0 waiting for node 1",
            details=d0.log_text,
        )
        assert waiting[0]["checkpoint"] == "step-10" and waiting[0]["missing_nodes"] == [1]
        assert d0.metric("ckptd_checkpoints_waiting_for_nodes", run="run") == 1
        time.sleep(0.5)  # several poll intervals: still nothing may be committed
        assert committed_manifest(s3_client, s3_prefix, "run", "step-10") is None

        with d1:
            manifest = wait_until(
                lambda: committed_manifest(s3_client, s3_prefix, "run", "step-10"),
                30,
                "the global commit",
                details=lambda: d0.log_text()[-3000:] + d1.log_text()[-3000:],
            )
            wait_until(
                lambda: d0.metric("ckptd_checkpoints_waiting_for_nodes", run="run") == 0,
                10,
                "node 0 to see the commit",
            )
            assert d0.get_json("/v1/status")["runs"]["run"]["waiting"] == []
            assert d1.stop() == 0
        assert d0.stop() == 0

    expected = {**local_files(w0 / "step-10"), **local_files(w1 / "step-10")}
    assert manifest["nodes"] == 2
    assert sorted(f["path"] for f in manifest["files"]) == sorted(expected)

    cfg = ["--dest", s3_dest, "--endpoint-url", local_s3.endpoint_url]
    listed = run_cli("list", *cfg, "--run", "run", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [c["checkpoint"] for c in json.loads(listed.stdout)["checkpoints"]] == ["step-10"]
    part = run_cli(
        "restore", *cfg, "--run", "run", "--latest", "--part", "1", "--to", str(tmp_path / "p1")
    )
    assert part.returncode == 0, part.stderr
    assert local_files(tmp_path / "p1" / "step-10") == local_files(w1 / "step-10")
    whole = run_cli("restore", *cfg, "--run", "run", "--latest", "--to", str(tmp_path / "all"))
    assert whole.returncode == 0, whole.stderr
    assert local_files(tmp_path / "all" / "step-10") == expected


def test_sigterm_on_a_follower_node_waits_for_its_share_of_the_emergency_save(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    d0, w0 = node_daemon(tmp_path, 0, s3_dest, local_s3.endpoint_url)
    d1, w1 = node_daemon(tmp_path, 1, s3_dest, local_s3.endpoint_url)
    d1.extra_args = ["--shutdown-timeout", "60"]
    with d1:
        assert d1.proc is not None
        d1.proc.send_signal(signal.SIGTERM)  # the node is being preempted
        wait_until(
            lambda: d1.events_named("notice_received"), 10, "the notice", details=d1.log_text
        )
        # The trainer's emergency save: node 1's shards; node 0's daemon is not up yet.
        for r in (2, 3):
            write_bytes(w1 / "step-30" / f"__{r}_0.distcp", 64 * 1024 + r)
        wait_until(
            lambda: d1.events_named("checkpoint_detected", checkpoint="step-30"),
            10,
            "node 1 to see its shards",
        )
        # Idle, but its share is not announced yet: the flush must not end. (Without the
        # wait it would exit after 2 s of quiet.)
        time.sleep(4)
        assert d1.alive(), d1.log_text()[-2000:]
        for r in (0, 1):
            write_bytes(w0 / "step-30" / f"__{r}_0.distcp", 64 * 1024 + r)
        write_bytes(w0 / "step-30" / ".metadata", 2000)
        with d0:
            assert d1.proc.wait(timeout=30) == 0
            manifest = wait_until(
                lambda: committed_manifest(s3_client, s3_prefix, "run", "step-30"),
                30,
                "the global commit",
            )
    assert {f["path"] for f in manifest["files"]} >= {"__2_0.distcp", "__3_0.distcp", ".metadata"}
