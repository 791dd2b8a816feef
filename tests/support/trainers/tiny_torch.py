"""A tiny PyTorch trainer for the drill tests: a linear model trained on the CPU until the
daemon's notice, then saved (model, optimizer, step; ``COMPLETE`` last, the ``marker``
layout) and stopped. ``load`` is its own load function, which the drill's load check
(``tests.support.trainers.load_check``) calls as a user's would."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import ckptd.trainer


def build(lr: float = 0.01) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def save(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    directory.mkdir()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    torch.save(state, directory / "state.pt")
    (directory / "COMPLETE").write_text(str(step))  # last: the checkpoint is whole


def load(directory: Path) -> int:
    """Load a checkpoint into a fresh model and optimizer, as a resume does; its step."""
    model, optimizer = build()
    state = torch.load(directory / "state.pt", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--pidfile", type=Path, required=True)
    options = parser.parse_args()
    ckptd.trainer.install(options.dir)  # before the pidfile: the daemon may signal from then on
    model, optimizer = build()
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True)
    options.pidfile.write_text(str(os.getpid()))
    step = 0
    while not ckptd.trainer.preempted():
        step += 1
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        (options.dir / ".progress").write_text(str(step))
        time.sleep(0.01)
    save(options.dir / f"step-{step}", model, optimizer, step)
    (options.dir / ".saved").write_text(f"step-{step}")


if __name__ == "__main__":
    main()
