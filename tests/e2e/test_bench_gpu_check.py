"""The benchmarks of issue 26 run, briefly, on CPU: ``bench/gpu_check.sh --device cpu
--short`` (the GPU check's CI variant: real trainers under ``ckptd exec``, a notice,
``kill -9``, a fresh node, final weights against the uninterrupted run) and
``bench/bench_agree.py`` (the agreement's price per step, gloo). They prove the scripts
work end to end, so that they are known to run when a GPU is lent; the figures they
print are not asserted (a loaded machine moves them), only that they are there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env.update(PYTHON=sys.executable, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    return env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gpu_check_runs_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "check.json"
    done = subprocess.run(
        # One trainer (DCP): the HF Trainer's kill, notice and fresh node are proven by
        # test_exec and test_lossless_resume; this proves the check's own plumbing.
        [
            *(str(REPO / "bench" / "gpu_check.sh"), "--device", "cpu", "--short"),
            *("--trainers", "pytorch-dcp", "--json", str(out)),
        ],
        env=bench_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["machine"]["device"] == "cpu"
    rows = {row["trainer"]: row for row in report["rows"]}
    assert set(rows) == {"pytorch-dcp"}
    for name, row in rows.items():
        assert row["identical"] and row["uninterrupted_identical"], row
        assert row["step_ms_without"] > 0 and row["step_ms_with"] > 0, row
        # kill -9 past the first save: the successor resumed from a save, not from scratch.
        assert 0 < row["restarted_from"] <= row["killed_at_step"], row
        # The fresh node resumed from the emergency checkpoint the notice made.
        assert row["emergency_checkpoint"].endswith(str(row["fresh_node_resumed_from"])), row
        assert 0 < row["notice_to_committed_s"] < 120, row
        assert f"| {name} | {row['steps']} |" in done.stdout
    assert "bit-identical" in done.stdout


def test_bench_agree_runs_briefly(tmp_path: Path) -> None:
    out = tmp_path / "agree.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "bench_agree.py"),
            *("--ranks", "2,4", "--steps", "40", "--block", "20", "--json", str(out)),
        ],
        env=bench_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["ranks"], row["steps_per_mode"]) for row in rows] == [(2, 20), (4, 20)]
    for row in rows:
        assert row["step_us_without"] > 0 and row["step_us_with"] > 0, row
        assert row["agree_only_us"] > 0, row
        assert f"| {row['ranks']} | 20 |" in done.stdout
