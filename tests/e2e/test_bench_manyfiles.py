"""``bench/bench_manyfiles.py --smoke`` and ``bench/bench_small_requests.py`` run, briefly:
every part of the many-files benchmark still works end to end (upload and restore checked
on the bytes, requests counted through the fault proxy, the scale part's restore and
retention), and the three small-request clients each read back what they wrote. The
timings are printed, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_bench_manyfiles_smoke_ships_restores_and_retires_in_one_request_per_file(
    tmp_path: Path,
) -> None:
    out = tmp_path / "manyfiles.json"
    done = subprocess.run(
        [
            *(sys.executable, str(REPO / "bench" / "bench_manyfiles.py"), "--smoke"),
            *("--json", str(out), "--workdir", str(tmp_path / "work")),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    results = doc["results"]
    assert {(r["direction"], r["tool"]) for r in results} >= {("up", "ckptd"), ("down", "ckptd")}
    assert all(r["error"] is None for r in results), results
    counted = doc["requests"]["50x4"]["ckptd"]
    assert counted["up_on_files"] == 1.0 and counted["down_on_files"] == 1.0, counted
    scale = doc["scale"]
    assert scale["files"] == 200 and scale["restore"]["ok"], scale
    assert scale["first_deleted_by_retention"], scale
    assert "| down | ckptd |" in done.stdout


def test_bench_small_requests_runs_briefly_and_every_client_reads_back_its_bytes(
    tmp_path: Path,
) -> None:
    out = tmp_path / "small.json"
    done = subprocess.run(
        [
            *(sys.executable, str(REPO / "bench" / "bench_small_requests.py")),
            *("--objects", "60", "--size-kib", "4", "--runs", "1", "--json", str(out)),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    # The bench exits non-zero naming the client when a byte read back differs.
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"botocore", "direct", "crt"}
    assert all(m["put_wall"] > 0 and m["get_wall"] > 0 for m in medians.values()), medians
