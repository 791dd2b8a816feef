"""A stand-in trainer that saves a checkpoint on each SIGUSR1, as a trainer whose handler
saves on every signal does: a second signal inside one notice means a second emergency
checkpoint (``tests/e2e/test_preemption_restart.py``). It records each signal
(``<signal number> <unix time>`` per line in ``--record``), writes its pidfile once the
handler is in place, and each save is ``checkpoint-<n>`` (HF-shaped, ``--mib`` MiB of random
bytes, ``trainer_state.json`` last). With ``--part NAME`` the weights file is
``model-NAME.safetensors``: one node's part of a many-node checkpoint, the state file the
same on every node."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from types import FrameType


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--pidfile", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--part", default="")
    options = parser.parse_args()
    pending: list[float] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        pending.append(time.time())
        with options.record.open("a") as out:
            out.write(f"{signum} {time.time():.6f}\n")

    signal.signal(signal.SIGUSR1, on_signal)
    options.pidfile.write_text(str(os.getpid()))
    saves = 0
    ends = time.monotonic() + options.max_seconds
    while time.monotonic() < ends:
        if pending:
            pending.pop()
            saves += 1
            d = options.ckpt_dir / f"checkpoint-{100 + saves}"
            d.mkdir(parents=True)
            weights = f"model-{options.part}.safetensors" if options.part else "model.safetensors"
            (d / weights).write_bytes(os.urandom(options.mib << 20))
            (d / "trainer_state.json").write_text(json.dumps({"global_step": 100 + saves}))
        time.sleep(0.02)


if __name__ == "__main__":
    main()
