"""A tiny GPT-2 (from a config: nothing downloaded) under ``transformers.Trainer`` with
``CkptdCallback``; checkpoints are the Trainer's own ``checkpoint-<N>/`` (layout ``hf``).

``--preset small`` is a GPT-2 big enough to keep a GPU busy (``bench/gpu_check.py``); on
CUDA it trains in bf16 (autocast), on CPU in float32."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ckptd.trainer.hf import CkptdCallback
from tests.support.trainers.common import (
    Reporter,
    cpu_state_dict,
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


# model and data: (n_layer, n_embd, n_head, vocab, sequence length, batch, sequences)
PRESETS = {"tiny": (2, 32, 2, 96, 16, 4, 64), "small": (4, 512, 8, 1024, 256, 32, 512)}


def main() -> None:
    cli = parser()
    cli.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    options = cli.parse_args()
    # Builds the listener: before the pidfile.
    ckptd_callback = None if options.without_ckptd else CkptdCallback(options.ckpt_dir)
    options.pidfile.write_text(str(os.getpid()))
    deterministic()
    n_layer, n_embd, n_head, vocab, length, batch, size = PRESETS[options.preset]
    on_cpu = options.device == "cpu"

    # Dropout stays at GPT-2's 0.1: the RNG state must come back too.
    model = tiny_gpt2(
        n_layer=n_layer, n_embd=n_embd, vocab_size=vocab, n_head=n_head, n_positions=length
    )
    # On a GPU the Trainer runs ahead of it between logging steps: batches copied from
    # pinned memory without waiting, no per-step NaN check (a read-back), and
    # full_determinism off, which would set CUDA_LAUNCH_BLOCKING=1 (deterministic() has
    # set what it sets otherwise; the Trainer seeds).
    gpu: dict[str, Any] = {}
    if not on_cpu:
        gpu = {
            "dataloader_pin_memory": True,
            "accelerator_config": {"non_blocking": True},
            "logging_nan_inf_filter": False,
        }
    args = cpu_training_args(
        str(options.ckpt_dir),
        use_cpu=on_cpu,
        bf16=not on_cpu,
        **gpu,
        per_device_train_batch_size=batch,
        max_steps=options.max_steps,
        save_strategy="steps",
        save_steps=options.save_every,
        save_total_limit=2,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        full_determinism=on_cpu,
    )
    resumed_from = 0
    if options.resume is not None:
        resumed_from = int(options.resume.name.rsplit("-", 1)[1])
    reporter = Reporter(options.progress, resumed_from)
    steps = Steps(reporter, options.hang_at, options.step_delay, options.pause_at)
    trainer = Trainer(
        model=model,
        args=args,
        # 16 steps per epoch
        train_dataset=RandomTokens(size=size, length=length, vocab=vocab, seed=1234),
        callbacks=[steps] + ([ckptd_callback] if ckptd_callback is not None else []),
    )
    trainer.train(resume_from_checkpoint=str(options.resume) if options.resume else None)
    step = trainer.state.global_step
    fired = ckptd_callback.fired_at_step if ckptd_callback is not None else None
    if step == options.max_steps and fired is None:
        torch.save(cpu_state_dict(model), options.final)
    write_json(
        options.result,
        {
            "step": step,
            "saved": f"checkpoint-{fired}" if fired is not None else None,
            "preempted": fired is not None,
            "step_ends": reporter.ends,
        },
    )


if __name__ == "__main__":
    main()
