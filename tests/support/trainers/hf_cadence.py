"""A tiny Hugging Face Trainer that saves on the daemon's advised interval, for the tests.

``CkptdCallback(follow_advice=True)``; no ``save_steps`` saves. Preemption notices are
listened for elsewhere (``--notice-dir``), so the daemon's notices raise the run's
interruption rate without stopping this trainer. Each save is logged to ``--saves`` as
a JSON line: step, when it began and ended (monotonic), and the interval followed.
Training stops when the ``--stop`` file appears.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ckptd.trainer.cadence import AdvisedCadence
from ckptd.trainer.hf import CkptdCallback
from ckptd.trainer.listener import PreemptionListener
from tests.support.trainers.procs import write_atomically
from tests.support.trainers.tiny_gpt2 import RandomTokens, cpu_training_args, tiny_gpt2


class SaveLog(TrainerCallback):
    """Logs each save (after CkptdCallback's on_save has timed it) and watches --stop."""

    def __init__(self, ckptd: CkptdCallback, saves: Path, stop: Path, progress: Path) -> None:
        self.ckptd, self.saves, self.stop, self.progress = ckptd, saves, stop, progress
        self.decided_interval: float | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        write_atomically(self.progress, str(state.global_step))
        if control.should_save:
            self.decided_interval = self.ckptd.cadence.interval()
        if self.stop.exists():
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        line = {
            "step": state.global_step,
            "began": self.ckptd._step_end,
            "ended": time.monotonic(),
            "interval": self.decided_interval,
            "advised": state.global_step in self.ckptd.advised_saves,
        }
        with self.saves.open("a") as f:
            f.write(json.dumps(line) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--progress", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--saves", type=Path, required=True)
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--notice-dir", required=True)
    options = parser.parse_args()

    listener = PreemptionListener(options.notice_dir, url="")
    cadence = AdvisedCadence(options.output_dir, refresh_seconds=0.1)
    ckptd_callback = CkptdCallback(listener=listener, follow_advice=True, cadence=cadence)
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=1, n_embd=16, vocab_size=64)
    args = cpu_training_args(
        options.output_dir, max_steps=1_000_000, save_strategy="no", save_total_limit=4
    )
    log = SaveLog(ckptd_callback, options.saves, options.stop, options.progress)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(size=256, length=16, vocab=64),
        callbacks=[ckptd_callback, log],
    )
    trainer.train()
    write_atomically(options.result, json.dumps({"global_step": trainer.state.global_step}))


if __name__ == "__main__":
    main()
