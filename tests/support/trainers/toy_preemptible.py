"""A toy trainer for the preemption tests: trains until told, then saves an HF-shaped
checkpoint (``trainer_state.json`` last) and exits 0.

It learns of the notice through ``ckptd.trainer`` (the daemon's signal, or the notice
file), exactly as a user's trainer would.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ckptd.trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--pidfile", type=Path, required=True)
    parser.add_argument("--mib", type=int, default=8)
    # Many nodes: every node saves under one name; only one holds the commit record.
    parser.add_argument("--name", default="checkpoint-{step}")
    parser.add_argument("--shard", default="model.safetensors")
    parser.add_argument("--no-commit-record", action="store_true")
    options = parser.parse_args()
    ckptd.trainer.install(options.dir)  # before the pidfile: the daemon may signal from then on
    options.pidfile.write_text(str(os.getpid()))
    step = 0
    while not ckptd.trainer.preempted():
        step += 1
        (options.dir / ".progress").write_text(str(step))
        ckptd.trainer.report_step(step)
        time.sleep(0.01)
    target = options.dir / options.name.format(step=step)
    target.mkdir()
    (target / options.shard).write_bytes(os.urandom(options.mib * 1024 * 1024))
    if not options.no_commit_record:
        (target / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (options.dir / ".saved").write_text(target.name)


if __name__ == "__main__":
    main()
