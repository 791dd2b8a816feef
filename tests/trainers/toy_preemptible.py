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
    options = parser.parse_args()
    ckptd.trainer.install(options.dir)  # before the pidfile: the daemon may signal from then on
    options.pidfile.write_text(str(os.getpid()))
    step = 0
    while not ckptd.trainer.preempted():
        step += 1
        (options.dir / ".progress").write_text(str(step))
        time.sleep(0.01)
    target = options.dir / f"checkpoint-{step}"
    target.mkdir()
    (target / "model.safetensors").write_bytes(os.urandom(options.mib * 1024 * 1024))
    (target / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (options.dir / ".saved").write_text(target.name)


if __name__ == "__main__":
    main()
