"""``bench/bench_fleet.py --smoke`` runs (#48, CI's short version of the fleet campaign):
two nodes on the namespace rig, a notice then a kill from the smoke trace, the job run
uninterrupted and under ``ckptd exec``. Judged on the figures the bench wrote
(``figures.json``, computed from the trainers' own logs): under ckptd the notice cost no
step, every resume succeeded, and the final weights equal the uninterrupted run's bit for
bit. Timings are printed, never asserted; the bench's own deadlines are generous, so a
loaded machine makes it slower, not red."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.netns import RigUnavailable, check_available

REPO = Path(__file__).resolve().parents[2]


def test_bench_fleet_smoke_ckptd_loses_no_step_on_a_notice_and_ends_bit_identical(
    tmp_path: Path,
) -> None:
    try:
        check_available()
    except RigUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    out = tmp_path / "fleet"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_fleet.py"), "--smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    figures = json.loads((out / "figures.json").read_text())
    assert figures["uninterrupted"]["finished"], figures["uninterrupted"]
    ckptd = figures["ckptd"]
    assert ckptd["finished"], ckptd
    kinds = [i["kind"] for i in ckptd["interruptions"]]
    assert "notice" in kinds, ckptd["interruptions"]
    assert all(lost == 0 for lost in ckptd["lost_steps_by_kind"]["notice"]), ckptd
    assert ckptd["resume_success_rate"] == 1.0, ckptd["interruptions"]
    assert ckptd["bit_identical"] is True, (ckptd["digest"], figures["uninterrupted"]["digest"])
    assert (out / "timeline.html").exists() or "no timeline" in done.stdout
