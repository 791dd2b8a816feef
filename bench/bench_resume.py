"""Lossless resume, measured: interrupt real trainers under the real daemon, restore each
time onto a fresh node, and compare the final weights with an uninterrupted run.

    .venv/bin/python bench/bench_resume.py [--trainers pytorch-dcp,hf-trainer,lightning] [--seed N]

Prints one markdown table per trainer: each interruption (a preemption notice from a fake
EC2 metadata service, or ``kill -9`` of trainer and daemon with the local disk wiped),
the steps lost, ``ckptd restore`` time, time to resume (restore + daemon and trainer
start-up to the trainer's first step) and whether the final weights are bit-identical.
The machinery is ``tests/support/harness.py``, the same as ``tests/e2e/test_lossless_resume.py``;
one loopback SeaweedFS (``ckptd.devtools.locals3``) is the destination.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: find tests.e2e
sys.path.insert(0, str(REPO / "bench"))  # and common

from common import use_local_s3_identity  # noqa: E402

from ckptd.devtools.locals3 import LocalS3  # noqa: E402
from tests.support.harness import HF, LIGHTNING, PLAIN, Env, lossless_resume, markdown  # noqa: E402

SPECS = {spec.name: spec for spec in (PLAIN, HF, LIGHTNING)}
BUCKET = "ckpt"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", default=",".join(SPECS))
    parser.add_argument("--seed", type=int, default=20261202)
    options = parser.parse_args()
    names = [n for n in options.trainers.split(",") if n]
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        parser.error(f"unknown trainer(s) {unknown}; known: {sorted(SPECS)}")

    use_local_s3_identity()

    failed = False
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-resume-") as tmp:
        work = Path(tmp)
        server = LocalS3(work / "seaweedfs", buckets=(BUCKET,)).start()
        try:
            cpus = len(os.sched_getaffinity(0))
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"# Lossless resume ({cpus} CPUs, load average {load} at start)\n")
            for name in names:
                spec = SPECS[name]
                env = Env(f"s3://{BUCKET}/bench-resume-{uuid.uuid4().hex[:8]}", server.endpoint_url)
                report = lossless_resume(
                    spec,
                    work / name,
                    env,
                    seed=options.seed,
                    log=lambda line: print(line, file=sys.stderr),
                )
                print(markdown(report) + "\n")
                failed |= not report.identical
        finally:
            server.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
