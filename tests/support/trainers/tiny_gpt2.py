"""The tiny GPT-2 the trainer tests share: built from a config (nothing downloaded) and
fed random tokens, small enough to train on CPU in seconds."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``size`` sequences of ``length`` token ids below ``vocab``, the same for a seed."""

    def __init__(self, size: int, length: int, vocab: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (size, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_gpt2(
    *, n_layer: int, n_embd: int, vocab_size: int, n_head: int = 2, n_positions: int = 32
) -> GPT2LMHeadModel:
    """GPT-2 with two heads and 32 positions unless told; dropout stays at GPT-2's 0.1.
    Attention is the eager one: deterministic on CUDA too (the fused ones' backward
    is not everywhere)."""
    config = GPT2Config(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=vocab_size,
        n_positions=n_positions,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def cpu_training_args(output_dir: str, **overrides: Any) -> TrainingArguments:
    """The Trainer settings every test run shares: CPU, batch 4, seed 0, no logging,
    reporting, progress bar or loader workers; ``overrides`` add the run's own."""
    settings: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "logging_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    settings.update(overrides)  # a GPU run says use_cpu=False
    return TrainingArguments(output_dir=output_dir, **settings)
