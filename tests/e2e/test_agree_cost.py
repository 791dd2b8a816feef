"""What the ranks' agreement costs per step: one collective, on a CPU tensor, never a
device synchronisation, on a backend reported as NCCL as on gloo.

Real torch.distributed (gloo, 2 ranks as two processes); ``agree_count.py`` counts every
call of ``torch.distributed``'s collective functions per step and refuses every
``torch.cuda`` / ``torch.accelerator`` call that synchronises or picks a device.

What this proves, and what not: with the default group reporting "nccl" (its
``get_backend`` patched; it is gloo underneath, this machine has no GPU), ckptd makes
one gloo side group, once, and every step's agreement is one all-reduce of a CPU tensor
over it, never over the default group, and never asks for a CUDA device or a sync. A
real NCCL group is not exercised here: ``bench/gpu_check.sh`` runs on one when a GPU is
lent. The old code (a tensor on ``torch.cuda.current_device()``, two all-reduces per
step in the callbacks with ``follow_advice``) fails each of these assertions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import free_port
from tests.support.trainers.procs import script_env

WORLD = 2
STEPS = 5


def run_ranks(tmp_path: Path, pretend_backend: str | None) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    port = free_port()
    procs = []
    for rank in range(WORLD):
        home = tmp_path / f"rank-{rank}"
        home.mkdir()
        env = script_env(
            home,
            RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        args = ["--out", str(home / "out.json"), "--watch", str(home / "watch")]
        args += ["--steps", str(STEPS)]
        if pretend_backend:
            args += ["--pretend-backend", pretend_backend]
        (home / "watch").mkdir()
        log = (home / "log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.trainers.agree_count", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )
        log.close()
    try:
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout=240)
            log_text = (tmp_path / f"rank-{rank}" / "log").read_text(errors="replace")
            assert code == 0, log_text[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads((tmp_path / f"rank-{r}" / "out.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("backend", ["nccl", None], ids=["reported-nccl", "gloo"])
def test_one_cpu_collective_per_step_and_no_device_sync(
    tmp_path: Path, backend: str | None
) -> None:
    results = run_ranks(tmp_path, backend)
    for result in results:
        assert result["device_calls"] == []
        # The side group: made once (at the first agreement), and only for a GPU backend.
        assert result["new_groups"] == (["gloo"] if backend else [])
        for name, records in result["scenarios"].items():
            assert len(records) == STEPS, name
            for n, record in enumerate(records, 1):
                where = f"rank {result['rank']} {name} step {n}: {record}"
                assert record["collectives"] <= 1, where
                assert record["devices"] in ([], ["cpu"]), where
                if backend:
                    assert record["over_default_group"] == 0, where
        # Every step that decides is one all-reduce (HF stops asking once it has fired).
        for name in ("agree", "agree_two", "lightning"):
            assert [r["collectives"] for r in result["scenarios"][name]] == [1] * STEPS, name
        assert [r["collectives"] for r in result["scenarios"]["hf"]] == [1, 1, 1, 0, 0]

    # The same answer on every rank at the same step: each flag OR-ed over the ranks.
    for name in ("agree", "agree_two", "hf"):
        answers = [[r["answer"] for r in result["scenarios"][name]] for result in results]
        assert answers[0] == answers[1], name
    agree = [r["answer"] for r in results[0]["scenarios"]["agree"]]
    assert agree == [[False], [False], [True], [False], [False]]
    two = [r["answer"] for r in results[0]["scenarios"]["agree_two"]]
    assert two == [[False, False], [True, False], [False, False], [False, True], [False, True]]
    # Rank 1 alone had the notice before step 3; both callbacks fired at step 3.
    hf = [r["answer"] for r in results[0]["scenarios"]["hf"]]
    assert hf == [None, None, 3, 3, 3]
    assert all(result["hf_should_save"] for result in results)
