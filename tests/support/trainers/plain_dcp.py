"""A plain PyTorch loop that saves with ``ckptd.trainer.state`` (DCP layout ``step-<N>/``)
on ckptd's notice and then stops, or trains on when the notice asks for a save only (a
health ``save``: ``ckptd.trainer.stop_requested()``; with ``--stop-on-any-notice`` it
stops on every notice, as a loop that breaks on ``preempted()`` alone does). The steps it
saved at for a notice are ``--result``'s ``notice_saves``.

Randomness from every source the helper must restore: dropout (torch CPU RNG, or the
CUDA one with ``--device cuda``), input noise (NumPy), a loss scale (Python ``random``), a
shuffled data order across epochs (``ResumableSampler``), AdamW moments and a cosine LR
schedule. ``--width``, ``--hidden-layers`` and ``--batch`` make it big enough to keep a
GPU busy (``bench/gpu_check.py``); the defaults are the tests' small model. Float32.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

import ckptd.trainer
from ckptd.trainer.state import ResumableSampler, load_training_state, save_training_state
from tests.support.trainers.common import (
    Reporter,
    cpu_state_dict,
    deterministic,
    first_time_here,
    hang_forever,
    parser,
    pause_until_noticed,
    write_json,
)

STEPS_PER_EPOCH = 25


def main() -> None:
    cli = parser()
    cli.add_argument("--width", type=int, default=64)
    cli.add_argument("--hidden-layers", type=int, default=0, help="extra width x width layers")
    cli.add_argument("--batch", type=int, default=8)
    cli.add_argument("--stop-on-any-notice", action="store_true", help="break on preempted() alone")
    options = cli.parse_args()
    with_ckptd = not options.without_ckptd
    if with_ckptd:
        ckptd.trainer.install(options.ckpt_dir)  # before the pidfile: the daemon may signal
    options.pidfile.write_text(str(os.getpid()))
    device = torch.device(options.device)
    # On a GPU the loop runs ahead of it, as a tuned trainer does: batches copied from
    # pinned memory without waiting, and nothing read back per step.
    on_gpu = device.type == "cuda"
    samples = STEPS_PER_EPOCH * options.batch
    deterministic()
    random.seed(0)
    np.random.seed(0)

    data = torch.Generator().manual_seed(1234)
    inputs = torch.randn(samples, 16, generator=data)
    targets = (inputs @ torch.randn(16, 1, generator=data)).tanh()
    sampler = ResumableSampler(samples, seed=99)
    # Its own generator: each iter(DataLoader) otherwise draws a seed from the global torch
    # RNG, and a resumed run makes its first iter() mid-epoch, where the original did not.
    loader = DataLoader(
        TensorDataset(inputs, targets),
        # Whole batches indexed at once, the same samples as batch_size=... would collate
        # one by one: a GPU-sized batch stays cheap on the CPU.
        sampler=BatchSampler(sampler, options.batch, drop_last=False),
        batch_size=None,
        generator=torch.Generator().manual_seed(0),
        pin_memory=on_gpu,
    )

    width = options.width
    hidden = [
        m
        for _ in range(options.hidden_layers)
        for m in (torch.nn.Linear(width, width), torch.nn.ReLU())
    ]
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        *hidden,
        torch.nn.Linear(width, 1),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=options.max_steps)

    step = 0
    if options.resume is not None:
        saved = load_training_state(
            options.resume, model=model, optimizer=optimizer, scheduler=scheduler
        )
        step = saved["step"]
        sampler.load_state_dict(saved["dataloader_state"])
    reporter = Reporter(options.progress, step)

    batches = iter(loader)
    saved_name = None
    notice_saves: list[int] = []
    while step < options.max_steps:
        try:
            x, y = next(batches)
        except StopIteration:  # the sampler moved on to the next epoch by itself
            batches = iter(loader)
            x, y = next(batches)
        noise = torch.from_numpy(np.random.standard_normal(x.shape)).float() * 0.01
        if on_gpu:
            noise = noise.pin_memory()
        x, y, noise = (t.to(device, non_blocking=on_gpu) for t in (x, y, noise))
        scale = random.uniform(0.9, 1.1)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x + noise), y) * scale
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        scheduler.step()
        step += 1
        if options.step_delay:
            time.sleep(options.step_delay)
        reporter.step_done(step)
        preempted = with_ckptd and ckptd.trainer.preempted()
        if step % options.save_every == 0 or preempted:
            path = options.ckpt_dir / f"step-{step}"
            save_began = time.time()
            save_training_state(
                path,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                step=step,
                dataloader_state=sampler.state_dict(),
            )
            saved_name = path.name
            if options.report_saves:
                ckptd.trainer.report_save(
                    options.ckpt_dir, checkpoint=path.name, seconds=time.time() - save_began
                )
        if preempted:
            notice_saves.append(step)
            if options.stop_on_any_notice or ckptd.trainer.stop_requested():
                break
        if step == options.hang_at or (
            step in options.hang_once_at and first_time_here(options.hang_marks, step)
        ):
            hang_forever()
        if step == options.pause_at:
            pause_until_noticed()

    if step == options.max_steps:
        torch.save(cpu_state_dict(model), options.final)
    write_json(
        options.result,
        {
            "step": step,
            "saved": saved_name,
            "preempted": step < options.max_steps,
            "notice_saves": notice_saves,
            "step_ends": reporter.ends,
        },
    )


if __name__ == "__main__":
    main()
