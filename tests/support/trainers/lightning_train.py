"""A tiny PyTorch Lightning run on CPU with ckptd's callback, for the tests."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptd.trainer.lightning import CkptdLightningCallback
from tests.support.trainers.procs import write_atomically


class TinyRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[:, :8]), batch[:, 8:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader[torch.Tensor]:
        data = torch.randn(4096, 9, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(data, batch_size=4)  # type: ignore[arg-type]


class Progress(pl.Callback):
    """Reports the last finished step and who handles SIGUSR1 once fit() has begun."""

    def __init__(self, path: Path, ckptd_callback: CkptdLightningCallback) -> None:
        self.path = path
        self.ckptd_callback = ckptd_callback
        self.handler_during_fit: str = ""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        handler = signal.getsignal(signal.SIGUSR1)
        ours = handler == self.ckptd_callback.listener._on_signal
        self.handler_during_fit = "ckptd" if ours else repr(handler)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        write_atomically(self.path, str(trainer.global_step))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root-dir", required=True)
    parser.add_argument("--checkpoint-dir", default=None, help="ModelCheckpoint dirpath")
    parser.add_argument("--slurm", action="store_true", help="as under SLURM, auto-requeue on")
    parser.add_argument("--progress", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=100_000)
    options = parser.parse_args()

    # Built first, at start-up: from here on the daemon's SIGUSR1 is caught.
    ckptd_callback = CkptdLightningCallback()
    progress = Progress(options.progress, ckptd_callback)
    callbacks: list[pl.Callback] = [ckptd_callback, progress]
    if options.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=options.checkpoint_dir, every_n_train_steps=10**6))
    trainer = pl.Trainer(
        default_root_dir=options.root_dir,
        max_steps=options.max_steps,
        max_epochs=-1,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        plugins=[SLURMEnvironment(auto_requeue=True)] if options.slurm else None,
        enable_checkpointing=bool(options.checkpoint_dir),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyRegression())
    saved = ckptd_callback.saved_path
    write_atomically(
        options.result,
        json.dumps(
            {
                "global_step": trainer.global_step,
                "saved_path": str(saved) if saved else None,
                "save_only_saves": [str(path) for path in ckptd_callback.save_only_saves],
                "handler_during_fit": progress.handler_during_fit,
                "handler_after_fit": "ckptd"
                if signal.getsignal(signal.SIGUSR1) == ckptd_callback.listener._on_signal
                else repr(signal.getsignal(signal.SIGUSR1)),
            }
        ),
    )


if __name__ == "__main__":
    main()
