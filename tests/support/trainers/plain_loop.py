"""A hand-written training loop that uses ``ckptd.trainer.preempted()``, for the tests.

No framework: each "step" updates a small state; a checkpoint is ``step-<N>/`` holding
``state.json`` and a ``COMPLETE`` marker.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import ckptd.trainer
from tests.support.trainers.procs import write_atomically


def save(checkpoint_root: Path, step: int, state: dict[str, float]) -> Path:
    directory = checkpoint_root / f"step-{step}"
    directory.mkdir(parents=True)
    (directory / "state.json").write_text(json.dumps({"step": step, **state}))
    (directory / "COMPLETE").touch()  # written last: the daemon's `marker` layout
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-root", type=Path, required=True)
    parser.add_argument("--progress", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=100_000)
    options = parser.parse_args()

    # At start-up, before anything else: the daemon may signal from now on.
    ckptd.trainer.install(options.checkpoint_root)

    state = {"weight": 0.0}
    saved = None
    step = 0
    while step < options.max_steps:
        step += 1
        state["weight"] += 0.001 * (1.0 - state["weight"])
        time.sleep(0.005)  # stands in for the forward/backward pass
        write_atomically(options.progress, str(step))
        if ckptd.trainer.preempted():
            saved = save(options.checkpoint_root, step, state)
            break

    write_atomically(
        options.result,
        json.dumps(
            {
                "global_step": step,
                "saved_path": str(saved) if saved else None,
                "notice": ckptd.trainer.notice(),
            }
        ),
    )


if __name__ == "__main__":
    main()
