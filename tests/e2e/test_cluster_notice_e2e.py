"""Cluster-wide preemption with real processes: two ``ckptd run`` daemons ([cluster]
nodes = 2, node_rank 0 and 1; own dirs, state, ports) on the SeaweedFS fixture, a real
trainer process beside each, and the loopback AWS IMDS fake preempting node 0 only."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3
from ckptd.notices.model import format_time, parse_time
from ckptd.repository import Repository
from ckptd.storage import open_storage
from tests.support.daemon import Daemon, committed_manifest, run_cli, wait_until
from tests.support.fakes.aws_imds import FakeAwsImds

# How soon node 1 must act on node 0's notice: node 0's poll (0.2 s), its NOTICE write,
# node 1's poll (0.2 s) and its signal, with room for this 2-core machine under load.
FOLLOW_DEADLINE_S = 10.0


@dataclass
class Node:
    rank: int
    root: Path
    daemon: Daemon
    pidfile: Path

    @property
    def watch(self) -> Path:
        return self.root / "run"

    def notice_file(self) -> dict[str, Any] | None:
        path = self.watch / ".ckptd" / "preemption.json"
        return json.loads(path.read_text()) if path.exists() else None

    def counted(self, event: str) -> float:
        return self.daemon.metric("ckptd_cluster_notices_total", run="run", event=event)


def make_node(
    tmp_path: Path, rank: int, local_s3: LocalS3, dest: str, *, aws_url: str = ""
) -> Node:
    root = tmp_path / f"node-{rank}"
    (root / "run").mkdir(parents=True)
    daemon = Daemon.configured(
        root,
        watch=[{"dir": root / "run", "run_id": "run", "layout": "hf", "settle_seconds": 0.2}],
        dest=dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=root / "state",
    )
    pidfile = root / "trainer.pid"
    text = daemon.config.read_text()
    if aws_url:
        text = text.replace('[preemption]\nprovider = "none"', "")
        text += (
            f'[preemption]\nprovider = "aws"\nendpoint = "{aws_url}"\npoll_interval_seconds = 0.2\n'
        )
    text += f'[trainer]\npidfile = "{pidfile}"\n'
    text += f"[cluster]\nnodes = 2\nnode_rank = {rank}\npoll_interval_seconds = 0.2\n"
    daemon.config.write_text(text)
    return Node(rank, root, daemon, pidfile)


class Processes:
    """Child processes of one test, ended (by PID) at its end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", *args], stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.close()


def signals_recorded(record: Path) -> list[tuple[int, float]]:
    if not record.exists():
        return []
    rows = [line.split() for line in record.read_text().splitlines() if line.strip()]
    return [(int(signum), float(at)) for signum, at in rows]


def test_a_notice_on_one_node_makes_every_node_signal_its_trainer(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_dest: str,
    processes: Processes,
) -> None:
    repo = Repository(open_storage(s3_dest, endpoint_url=local_s3.endpoint_url))
    # A previous cluster's NOTICE, still within its deadline: noticed before these
    # daemons started, so never followed.
    earlier = datetime.now(UTC) - timedelta(minutes=1)
    repo.write_notice(
        "run",
        {
            "source": "aws",
            "kind": "spot-termination",
            "noticed_at": format_time(earlier),
            "deadline": format_time(earlier + timedelta(minutes=30)),
            "node_rank": 0,
            "host": "gone",
            "id": "aws:earlier",
        },
    )
    imds = FakeAwsImds()
    url = imds.start_in_thread()
    try:
        nodes = [
            make_node(tmp_path, 0, local_s3, s3_dest, aws_url=url),
            make_node(tmp_path, 1, local_s3, s3_dest),
        ]
        records = [node.root / "signals" for node in nodes]
        trainers = [
            processes.start(
                "tests.support.trainers.signal_recorder",
                "--pidfile",
                str(node.pidfile),
                "--record",
                str(record),
            )
            for node, record in zip(nodes, records, strict=True)
        ]
        for node in nodes:
            wait_until(node.pidfile.exists, 30, f"trainer of node {node.rank} started")
        with nodes[0].daemon as d0, nodes[1].daemon as d1:
            # The stale NOTICE is read and ignored by both, and nothing is signalled.
            for d in (d0, d1):
                wait_until(
                    lambda d=d: d.events_named("cluster_notice_ignored"),
                    20,
                    "the stale NOTICE seen and ignored",
                    details=d.log_text,
                )
                reason = d.events_named("cluster_notice_ignored")[0]["reason"]
                assert reason.startswith("stale: noticed before"), reason
            assert d1.get_json("/v1/preemption") == {"notice": False}
            assert signals_recorded(records[0]) == signals_recorded(records[1]) == []

            triggered = time.time()
            spot_time = imds.trigger_spot("terminate")
            # Node 0 acts on its own notice; node 1 on node 0's NOTICE, from the store.
            for node, record in zip(nodes, records, strict=True):
                wait_until(
                    lambda record=record: signals_recorded(record),
                    FOLLOW_DEADLINE_S,
                    f"node {node.rank}'s trainer signalled",
                    details=node.daemon.log_text,
                )
            follower_signalled = signals_recorded(records[1])[0][1] - triggered
            print(f"node 1 signalled {follower_signalled:.3f} s after node 0's notice appeared")
            assert follower_signalled < FOLLOW_DEADLINE_S

            followed = wait_until(nodes[1].notice_file, 10, "node 1's preemption.json")
            assert followed["source"] == "node-0/aws"
            assert followed["kind"] == "spot-termination"
            assert parse_time(followed["deadline"]) == parse_time(spot_time)
            assert d1.get_json("/v1/preemption")["source"] == "node-0/aws"
            assert d1.events_named("trainer_signalled")[0]["pids"] == [trainers[1].pid]
            own = wait_until(nodes[0].notice_file, 10, "node 0's preemption.json")
            assert own["source"] == "aws"

            # The store holds node 0's notice, and nobody wrote it again.
            published = repo.read_notice("run")
            assert published is not None
            assert (published["node_rank"], published["source"]) == (0, "aws")
            assert nodes[0].counted("published") == 1
            assert nodes[1].counted("followed") == 1
            # Node 1's notice came from node 0: not published again (no echo), and
            # node 0 never follows its own.
            assert nodes[1].counted("published") == 0
            assert not d1.events_named("cluster_notice_published")
            assert nodes[0].counted("followed") == 0
            assert len(d0.events_named("notice_received")) == 1
            assert len(d1.events_named("notice_received")) == 1
            assert len(signals_recorded(records[0])) == len(signals_recorded(records[1])) == 1
            assert d0.alive() and d1.alive()
    finally:
        imds.stop_thread()


def test_a_drill_on_one_node_makes_every_nodes_trainer_save(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
    processes: Processes,
) -> None:
    nodes = [make_node(tmp_path, rank, local_s3, s3_dest) for rank in (0, 1)]
    # Both save under one name; node 0 writes the commit record (trainer_state.json).
    for node in nodes:
        processes.start(
            "tests.support.trainers.toy_preemptible",
            "--dir",
            str(node.watch),
            "--pidfile",
            str(node.pidfile),
            "--mib",
            "1",
            "--name",
            "checkpoint-999",
            "--shard",
            # Node 0 holds the weights the hf rule asks for (with trainer_state.json);
            # node 1 only another shard, as under FSDP.
            "model.safetensors" if node.rank == 0 else "rng_state_1.pth",
            *(["--no-commit-record"] if node.rank else []),
        )
    for node in nodes:
        wait_until(lambda node=node: (node.watch / ".progress").exists(), 30, "trainer started")
    with nodes[0].daemon as d0, nodes[1].daemon as d1:
        drill = run_cli("drill", "--deadline", "8", "--json", config=d0.config, timeout=60)
        report = json.loads(drill.stdout)
        # Node 1's trainer saved too, told by node 1's daemon following node 0's drill.
        for node in nodes:
            wait_until(
                lambda node=node: (node.watch / ".saved").exists(),
                FOLLOW_DEADLINE_S,
                f"node {node.rank}'s trainer saved",
            )
        assert d1.events_named("notice_received")[0]["source"] == "node-0/drill"
        assert d1.events_named("trainer_signalled")
        # The drill reports node 0's own emergency checkpoint, and that it published.
        assert report["notice_published"] is True
        assert report["notice"]["source"] == "drill"
        assert drill.returncode == 0, drill.stdout + drill.stderr
        assert report["checkpoint"] == "checkpoint-999"
        assert committed_manifest(s3_client, s3_prefix, "run", "checkpoint-999")
        # The follower leaves drill mode too, once the drill's deadline (8 s) is past at most.
        wait_until(
            lambda: d1.get_json("/v1/preemption") == {"notice": False},
            40,
            "node 1's drill ended",
        )
        # The text report says the same for a person.
        text = run_cli("drill", "--deadline", "2", config=d0.config, timeout=60)
        assert "cluster NOTICE" in text.stdout and "written" in text.stdout
