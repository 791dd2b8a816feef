"""The short version of ``bench/bench_scale.py`` parts 4 and 5, untimed: what a commit
and an idle node cost in store requests, counted by the fault proxy, does not grow with
the run's history (a real daemon, SeaweedFS keeping every emptied prefix listed) and is
bounded by the poll interval per idle node."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.repository import Repository
from ckptd.storage import open_storage
from tests.support.faultproxy import FaultProxy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _scale_fleet import measure_fleet
from _scale_run import long_run


def test_requests_per_commit_stay_flat_over_a_run_on_seaweedfs(
    tmp_path: Path, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    marks = long_run(
        tmp_path / "long",
        dest=s3_dest,
        endpoint=fault_proxy.url,
        port=free_port(),
        total=40,
        marks=[10, 40],
        count_requests=fault_proxy.count,
        env=dict(os.environ),
        progress=lambda _: None,
    )
    early, late = marks
    assert early.requests is not None and late.requests is not None
    # Flat: thirty commits and deletions later a commit costs what it did at the tenth
    # (before the catalog, each deleted checkpoint's listed prefix added two requests).
    assert late.requests <= early.requests + 1, (early, late)
    listed = Repository(open_storage(s3_dest, endpoint_url=fault_proxy.url)).list_names("run")
    assert len(listed) >= 37  # the emptied prefixes are still listed


def test_an_idle_fleet_costs_one_notice_read_per_node_per_poll(
    tmp_path: Path, local_s3: LocalS3
) -> None:
    row = measure_fleet(tmp_path, local_s3, 3, 6.0, lambda _: None)
    # Default poll interval 1 s: at most one NOTICE read per node per second; besides,
    # at most the minute's health HEAD per node and node 0's cadence GET and PUT.
    assert 0 < row.idle_per_node_minute("GET NOTICE") <= 66, row.idle
    assert sum(row.idle.values()) - row.idle["GET NOTICE"] <= 3 + 2, row.idle
    assert row.record_to_commit_s is not None  # the sharded checkpoint committed
