"""Ranks agree on one save step: real torch.distributed (gloo), 2 "nodes" x 2 ranks as
four processes, one rank of one node told of the notice at a random instant."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import free_port
from ckptd.trainer import agree_to_save
from tests.support.daemon import read_pid, wait_until
from tests.support.trainers.procs import script_env

NODES = 2
RANKS_PER_NODE = 2
WORLD = NODES * RANKS_PER_NODE
ROUNDS = 6


def test_without_a_process_group_the_flag_is_returned_unchanged() -> None:
    assert agree_to_save(True) is True
    assert agree_to_save(False) is False


@pytest.mark.parametrize("backend", ["gloo", "mpi", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"])
def test_cpu_backends_take_a_cpu_tensor(backend: str) -> None:
    """Backends (or mixed groups) that serve CPU tensors get one: no GPU is touched."""
    from ckptd.trainer.agree import _device_for

    class Group:
        @staticmethod
        def get_backend(group: object) -> str:
            return backend

    assert str(_device_for(Group, None)) == "cpu"


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]]]]:
    work = tmp_path / "work"
    work.mkdir()
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = script_env(
            tmp_path,
            RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            LOCAL_RANK=str(rank % RANKS_PER_NODE),
            NODE_RANK=str(rank // RANKS_PER_NODE),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        log = (work / f"rank-{rank}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.support.trainers.agree_ranks",
                    "--work",
                    str(work),
                    "--rounds",
                    str(ROUNDS),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )
        log.close()
    try:
        yield work, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def reports(work: Path, rank: int) -> list[dict[str, Any]]:
    path = work / f"rank-{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_one_ranks_notice_makes_every_rank_save_the_same_step(
    ranks: tuple[Path, list[subprocess.Popen[bytes]]],
) -> None:
    work, procs = ranks
    seed = int(os.environ.get("CKPTD_TEST_SEED", time.time_ns() % 1_000_000))
    print(f"seed {seed}")
    rng = random.Random(seed)

    def logs() -> str:
        return "\n".join(
            f"--- rank {r}\n{(work / f'rank-{r}.log').read_text(errors='replace')[-2000:]}"
            for r in range(WORLD)
        )

    pids = [
        wait_until(lambda r=r: read_pid(work / f"rank-{r}.pid"), 60, "ranks up", details=logs)
        for r in range(WORLD)
    ]
    told = []
    for round_no in range(ROUNDS):
        # Every rank has saved the previous round, so each one's flag is down again.
        wait_until(
            lambda n=round_no: all(len(reports(work, r)) >= n for r in range(WORLD)),
            60,
            f"round {round_no - 1} saved by every rank",
            details=logs,
        )
        time.sleep(rng.uniform(0.0, 0.3))  # a random instant in the training loop
        rank = rng.randrange(WORLD)
        told.append(rank)
        os.kill(pids[rank], signal.SIGUSR1)
    for proc in procs:
        assert proc.wait(timeout=60) == 0, logs()

    by_rank = [reports(work, r) for r in range(WORLD)]
    for round_no, rank in enumerate(told):
        rows = [by_rank[r][round_no] for r in range(WORLD)]
        steps = {row["step"] for row in rows}
        assert len(steps) == 1, f"round {round_no}: ranks saved different steps {rows}"
        (step,) = steps
        # Only the told rank saw the notice itself, and every rank saved at that very step.
        assert [r for r, row in enumerate(rows) if row["first_local"] is not None] == [rank]
        assert rows[rank]["first_local"] == step
        # One collective save: each node holds its ranks' shards, node 0 the .metadata.
        node0 = work / "node-0" / "run" / f"step-{step}"
        node1 = work / "node-1" / "run" / f"step-{step}"
        assert (node0 / ".metadata").is_file()
        assert not (node1 / ".metadata").exists()
        assert sorted(p.name for p in node1.glob("*.distcp")) == ["__2_0.distcp", "__3_0.distcp"]
    print(f"told ranks {told}; steps {[row['step'] for row in by_rank[0]]}")


def test_hf_trainer_ranks_on_two_nodes_save_the_same_step(tmp_path: Path) -> None:
    """The HF Trainer callback under torch.distributed (gloo, 2 nodes x 1 rank, node-local
    output dirs): only node 1's rank is signalled, and both save checkpoint-N, one N."""
    pytest.importorskip("transformers")
    from tests.support.trainers.procs import Script

    port = free_port()
    scripts = []
    for node in range(2):
        home = tmp_path / f"node-{node}"
        home.mkdir()
        env = script_env(
            home,
            RANK=str(node),
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            NODE_RANK=str(node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        scripts.append(
            Script(
                home,
                "hf_train",
                "--output-dir",
                str(home / "out"),
                "--save-on-each-node",
                env=env,
            )
        )
    try:
        for script in scripts:
            script.wait_for_step(3, timeout=120)
        scripts[1].signal(signal.SIGUSR1)
        for script in scripts:
            assert script.wait_exit(timeout=60) == 0, script.log_tail()
    finally:
        for script in scripts:
            script.kill()
    results = [script.result_json() for script in scripts]
    step = results[1]["fired_at_step"]
    assert step is not None and step >= 3
    assert [r["fired_at_step"] for r in results] == [step, step]
    assert [r["global_step"] for r in results] == [step, step]
    for node in range(2):
        out = tmp_path / f"node-{node}" / "out"
        assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{step}"]
        assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file()
