"""``bench/bench_steps.py`` runs, briefly: the step report's cost per call in each mode,
and (where ``strace`` is installed) the guarantee the counter is built on: a report makes
no system call, where replacing ``steps.json`` makes several. The timings are printed,
never asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_steps_runs_briefly_and_the_counter_makes_no_system_call(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "bench_steps.py"),
            *("--calls", "300", "--rounds", "1", "--steps", "20"),
            *("--dir", str(tmp_path), "--json", str(out)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    modes = ("none", "counter", "json, every step", "json, every 5 s")
    assert set(doc["per_call_us"]) == set(modes)
    assert all(doc["per_call_us"][m] > 0 for m in modes), doc
    for mode in modes:
        assert f"| {mode} |" in done.stdout
    if shutil.which("strace") is not None:
        calls = doc["syscalls_per_call"]
        # Less than one call in ten: the interpreter's own allocations, as with no report.
        assert calls["counter"] < 0.1, calls
        assert calls["json, every step"] >= 2, calls  # open, write, rename at least
