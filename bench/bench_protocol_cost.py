"""What the commit protocol of slots and claims (docs/design.md "Slots, claims and
trajectories") costs against the ckptd before it, side by side in one run.

    .venv/bin/python bench/bench_protocol_cost.py [--baseline 218b27b] [--runs 3]
        [--run-length 2000] [--scale 1.0]

Both versions run from snapshots taken at the start (the working tree's ckptd, and
``git archive BASELINE ckptd``), one after the other, against fresh loopback SeaweedFS
servers, on the same data:

1. uploads (``bench/bench_upload.py --tools ckptd``): the HF- and DCP-shaped checkpoints,
   complete -> committed wall time and the client's CPU per GiB, medians of ``--runs``;
2. a long run (``bench/bench_scale.py`` part 4): one daemon commits ``--run-length``
   marker checkpoints; marker -> committed latency and store requests per commit (the
   fault proxy's count) at 10 and at ``--run-length``.

Prints both versions' figures and the change; the aim (issue #36) is no more than 5 % on
either. Run it on a quiet machine: the load average is printed at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import bench_scale
import bench_upload
from common import machine_line, snapshot_ckptd, snapshot_revision


def upload_medians(report: Path) -> dict[str, tuple[float, float]]:
    """shape -> (median wall s, median client CPU s per GiB) of bench_upload's JSON."""
    doc: dict[str, Any] = json.loads(report.read_text())
    out: dict[str, tuple[float, float]] = {}
    for shape in doc["shapes"]:
        runs = [r for r in doc["results"] if r["shape"] == shape and r["ok"]]
        if not runs:
            continue
        gib = runs[0]["bytes"] / 2**30
        wall = statistics.median(r["commit_s"] or r["wall_s"] for r in runs)
        cpu = statistics.median((r["user_s"] + r["sys_s"]) / gib for r in runs)
        out[shape] = (wall, cpu)
    return out


def change(now: float, then: float) -> str:
    return f"{100 * (now - then) / then:+.1f} %" if then else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="218b27b", help="git revision before the protocol")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="bench_upload's data scale")
    ap.add_argument("--run-length", type=int, default=2000)
    args = ap.parse_args()
    print(f"# The commit protocol's cost\n\n{machine_line()}; load average {os.getloadavg()}\n")
    with tempfile.TemporaryDirectory(prefix="ckptd-protocol-cost-") as tmp:
        work = Path(tmp)
        now, now_digest = snapshot_ckptd(work / "now")
        then, then_digest = snapshot_revision(args.baseline, work / "then")
        figures = {}
        for label, src in (("then", then), ("now", now)):
            report = work / f"upload-{label}.json"
            bench_upload.main(
                [
                    *("--tools", "ckptd", "--runs", str(args.runs), "--scale", str(args.scale)),
                    *("--saving", "", "--ckptd-src", str(src), "--json", str(report)),
                ]
            )
            figures[label] = upload_medians(report)
        print(f"\n## Uploads: {args.baseline} ({then_digest}) against now ({now_digest})\n")
        print(
            "| shape | wall s then | wall s now | change | CPU-s/GiB then | CPU-s/GiB now | change |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for shape, (wall_then, cpu_then) in figures["then"].items():
            wall_now, cpu_now = figures["now"].get(shape, (float("nan"), float("nan")))
            print(
                f"| {shape} | {wall_then:.2f} | {wall_now:.2f} | {change(wall_now, wall_then)} "
                f"| {cpu_then:.2f} | {cpu_now:.2f} | {change(cpu_now, cpu_then)} |"
            )
        print()
        bench_scale.main(
            [
                *("--parts", "4", "--run-length", str(args.run_length), "--stores", "s3"),
                *("--baseline", args.baseline),
            ]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
