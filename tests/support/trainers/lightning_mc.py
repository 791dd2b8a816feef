"""A small Lightning module under ``ModelCheckpoint(every_n_train_steps)`` and
``CkptdLightningCallback``; checkpoints are single files ``step=<N>.ckpt`` /
``preempt-step=<N>.ckpt`` (layout ``lightning``).

Lightning's checkpoint holds model, optimizer, LR scheduler and loop counters, but neither
the RNG states nor the data position of a plain ``DataLoader``: the module adds both in
``on_save_checkpoint`` (``ckptd.trainer.state.capture_rng_state`` and the step), and puts
them back before the first resumed batch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ckptd.layouts.base import step_of
from ckptd.trainer.lightning import CkptdLightningCallback
from ckptd.trainer.state import ResumableSampler, capture_rng_state, restore_rng_state
from tests.support.trainers.common import (
    Reporter,
    deterministic,
    hang_forever,
    parser,
    pause_until_noticed,
    write_json,
)

SAMPLES = 200
BATCH = 8  # 25 steps an epoch


class Regression(pl.LightningModule):
    def __init__(self, max_steps: int) -> None:
        super().__init__()
        self.max_steps = max_steps
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
        )
        data = torch.Generator().manual_seed(1234)
        self.inputs = torch.randn(SAMPLES, 16, generator=data)
        self.targets = (self.inputs @ torch.randn(16, 1, generator=data)).tanh()
        self.sampler = ResumableSampler(SAMPLES, seed=99)
        self._rng_to_restore: dict[str, Any] | None = None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.max_steps)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            TensorDataset(self.inputs, self.targets),
            batch_size=BATCH,
            sampler=self.sampler,
            generator=torch.Generator().manual_seed(0),
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Saved at the end of batch N (global_step N): the next batch is number N of the
        # run. Lightning's fetcher has already pulled it, so the sampler's own count is
        # one batch ahead; the step is what the position is.
        step = self.trainer.global_step
        checkpoint["ckptd"] = {
            "rng": capture_rng_state(),
            "sampler": {
                "seed": self.sampler.seed,
                "epoch": step // 25,
                "offset": step % 25 * BATCH,
            },
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint["ckptd"]
        self.sampler.load_state_dict(saved["sampler"])
        self._rng_to_restore = saved["rng"]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._rng_to_restore is not None:
            restore_rng_state(self._rng_to_restore)
            self._rng_to_restore = None


class Steps(pl.Callback):
    def __init__(self, reporter: Reporter, hang_at: int, delay: float, pause_at: int) -> None:
        self.reporter = reporter
        self.hang_at = hang_at
        self.delay = delay
        self.pause_at = pause_at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.delay:
            time.sleep(self.delay)
        self.reporter.step_done(trainer.global_step)
        # ModelCheckpoint runs after every other callback: this step's save (never a
        # hang step) has not happened yet.
        if trainer.global_step == self.hang_at:
            hang_forever()
        if trainer.global_step == self.pause_at:
            pause_until_noticed()


def main() -> None:
    options = parser().parse_args()
    ckptd_callback = CkptdLightningCallback(watch_dir=options.ckpt_dir)  # before the pidfile
    options.pidfile.write_text(str(os.getpid()))
    deterministic()
    model = Regression(options.max_steps)
    resumed_from = (step_of(options.resume.name) or 0) if options.resume else 0
    trainer = pl.Trainer(
        max_steps=options.max_steps,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            Steps(
                Reporter(options.progress, resumed_from),
                options.hang_at,
                options.step_delay,
                options.pause_at,
            ),
            ckptd_callback,
            ModelCheckpoint(
                dirpath=options.ckpt_dir,
                filename="step={step}",
                auto_insert_metric_name=False,
                every_n_train_steps=options.save_every,
                save_top_k=-1,
                save_last=False,
            ),
        ],
    )
    trainer.fit(model, ckpt_path=str(options.resume) if options.resume else None)
    step = trainer.global_step
    saved = ckptd_callback.saved_path
    if step == options.max_steps and saved is None:
        torch.save(model.state_dict(), options.final)
    write_json(
        options.result,
        {"step": step, "saved": saved.name if saved else None, "preempted": saved is not None},
    )


if __name__ == "__main__":
    main()
