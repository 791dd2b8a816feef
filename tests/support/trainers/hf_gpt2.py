"""A tiny GPT-2 (from a config: nothing downloaded) under ``transformers.Trainer`` with
``CkptdCallback``; checkpoints are the Trainer's own ``checkpoint-<N>/`` (layout ``hf``)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ckptd.trainer.hf import CkptdCallback
from tests.support.trainers.common import (
    Reporter,
    deterministic,
    hang_forever,
    parser,
    pause_until_noticed,
    write_json,
)
from tests.support.trainers.tiny_gpt2 import RandomTokens, cpu_training_args, tiny_gpt2


class Steps(TrainerCallback):
    """Reports each finished step; simulates compute; blocks at ``--hang-at``."""

    def __init__(self, reporter: Reporter, hang_at: int, delay: float, pause_at: int) -> None:
        self.reporter = reporter
        self.hang_at = hang_at
        self.delay = delay
        self.pause_at = pause_at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.delay:
            time.sleep(self.delay)
        self.reporter.step_done(state.global_step)
        # Before this step's own save (the Trainer saves after on_step_end): the test
        # never hangs on a save step, so the last save is an earlier step's.
        if state.global_step == self.hang_at:
            hang_forever()
        if state.global_step == self.pause_at:
            pause_until_noticed()


def main() -> None:
    options = parser().parse_args()
    ckptd_callback = CkptdCallback(options.ckpt_dir)  # installs the listener: before the pidfile
    options.pidfile.write_text(str(os.getpid()))
    deterministic()

    # Dropout stays at GPT-2's 0.1: the RNG state must come back too.
    model = tiny_gpt2(n_layer=2, n_embd=32, vocab_size=96)
    args = cpu_training_args(
        str(options.ckpt_dir),
        max_steps=options.max_steps,
        save_strategy="steps",
        save_steps=options.save_every,
        save_total_limit=2,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        full_determinism=True,
    )
    resumed_from = 0
    if options.resume is not None:
        resumed_from = int(options.resume.name.rsplit("-", 1)[1])
    trainer = Trainer(
        model=model,
        args=args,
        # 16 steps per epoch
        train_dataset=RandomTokens(size=64, length=16, vocab=96, seed=1234),
        callbacks=[
            Steps(
                Reporter(options.progress, resumed_from),
                options.hang_at,
                options.step_delay,
                options.pause_at,
            ),
            ckptd_callback,
        ],
    )
    trainer.train(resume_from_checkpoint=str(options.resume) if options.resume else None)
    step = trainer.state.global_step
    fired = ckptd_callback.fired_at_step
    if step == options.max_steps and fired is None:
        torch.save(model.state_dict(), options.final)
    write_json(
        options.result,
        {
            "step": step,
            "saved": f"checkpoint-{fired}" if fired is not None else None,
            "preempted": fired is not None,
        },
    )


if __name__ == "__main__":
    main()
