"""A fresh node's start under ``ckptd exec``: from the end of the restore to the trainer's
start, at several quiet windows (``settle_seconds``).

    .venv/bin/python bench/bench_fresh_node.py [--trials 5] [--windows 0.2,2,20]

One loopback SeaweedFS; a first node commits an HF-shaped ``checkpoint-10`` (4 MiB); then
each trial is a fresh node (an empty directory) running ``ckptd exec`` around a one-line
trainer that records when it started and what ``CKPTD_RESUME_FROM`` said
(``tests/support/fresh_node.py``). Prints the median seconds from ``exec_restored`` to the
trainer's start, and whether every trainer was told to resume from the restore. Before
ckptd took its own restore as complete (docs/design.md "Restored checkpoints and fresh
nodes"), the trainer waited the whole window at 2 s and started from scratch beyond
``RESUME_SETTLE_MAX_SECONDS`` (15 s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import machine_line, use_local_s3_identity  # noqa: E402

from ckptd.devtools.locals3 import LocalS3, free_port  # noqa: E402
from tests.support.daemon import run_cli, write_config  # noqa: E402
from tests.support.fresh_node import fresh_start  # noqa: E402
from tests.support.writers import write_hf  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--windows", default="0.2,2,20")
    options = parser.parse_args()
    windows = [float(w) for w in options.windows.split(",")]
    use_local_s3_identity()
    print(f"# Fresh node: restore end -> trainer start\n\n{machine_line()}\n")
    print("| settle_seconds | median s | max s | told to resume from the restore |")
    print("| ---: | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-fresh-") as tmp:
        work = Path(tmp)
        server = LocalS3(work / "seaweedfs", buckets=("ckpt",)).start()
        try:
            dest = f"s3://ckpt/fresh-{uuid.uuid4().hex[:8]}"
            write_hf(work / "first" / "run", 10, model_bytes=4 << 20)
            config = write_config(
                work / "first.toml",
                watch=[{"dir": work / "first" / "run", "run_id": "run", "settle_seconds": 0}],
                dest=dest,
                endpoint_url=server.endpoint_url,
                state_dir=work / "first" / "state",
                port=free_port(),
            )
            if run_cli("run", "--once", config=config).returncode != 0:
                print("the first node did not commit", file=sys.stderr)
                return 1
            for window in windows:
                gaps, told = [], True
                for trial in range(options.trials):
                    node = work / f"node-{window}-{trial}"
                    start = fresh_start(
                        node, dest, server.endpoint_url, settle_seconds=window, port=free_port()
                    )
                    gaps.append(start.restore_to_start_s)
                    told = told and start.resume == str(node / "run" / "checkpoint-10")
                print(
                    f"| {window:g} | {statistics.median(gaps):.3f} | {max(gaps):.3f} | "
                    f"{'yes' if told else 'NO'} |"
                )
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
