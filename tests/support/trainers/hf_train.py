"""A tiny Hugging Face Trainer run on CPU with ckptd's callback, for the tests.

GPT-2 built from a one-layer config on random tokens: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ckptd.trainer.hf import CkptdCallback
from tests.support.trainers.procs import write_atomically
from tests.support.trainers.tiny_gpt2 import RandomTokens, cpu_training_args, tiny_gpt2


class Progress(TrainerCallback):
    """Reports the last finished step, so the test knows training is under way."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        write_atomically(self.path, str(state.global_step))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--progress", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--save-steps", type=int, default=100_000)
    # Under torch.distributed with node-local output dirs: each node's first rank saves.
    parser.add_argument("--save-on-each-node", action="store_true")
    options = parser.parse_args()

    # Built first, at start-up: from here on the daemon's SIGUSR1 is caught.
    ckptd_callback = CkptdCallback()

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=1, n_embd=16, vocab_size=64)
    args = cpu_training_args(
        options.output_dir,
        max_steps=options.max_steps,
        save_strategy="steps",
        save_steps=options.save_steps,
        save_on_each_node=options.save_on_each_node,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(size=256, length=16, vocab=64),
        callbacks=[ckptd_callback, Progress(options.progress)],
    )
    trainer.train()
    write_atomically(
        options.result,
        json.dumps(
            {
                "global_step": trainer.state.global_step,
                "fired_at_step": ckptd_callback.fired_at_step,
                "save_only_steps": ckptd_callback.save_only_steps,
                "notice": ckptd_callback.listener.notice(),
            }
        ),
    )
    # Under torch.distributed (the Trainer joined the group from the env): skip the
    # interpreter's teardown. One with gloo's threads still up aborted once in a full
    # run ("terminate called without an active exception", SIGABRT), and leaving the
    # group first waits on the other node, which may have gone. The result is written.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
