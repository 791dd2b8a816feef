"""A tiny real PyTorch trainer whose loss spikes, then turns NaN, as a diverging run's does
(``tests/e2e/test_loss_spike.py``): a linear regression on fresh random batches, on the
CPU, reporting each step's loss (``ckptd.trainer.report_step(step, loss=loss.item())``)
and saving ``step-N/`` (``state.pt``, then ``COMPLETE``: the marker layout) every
``--save-every`` steps.

At ``--spike-at`` its weights are thrown off (the loss jumps a thousandfold, for real,
through the model), and it waits there for ``--go`` to appear (the test lets it go on once
the daemon has acted: time passing, without a race); at ``--nan-at`` its weights turn NaN.

With ``--resume NAME`` it rolls back instead: it loads ``NAME`` from the watch dir, says so
(``report_resumed``), removes the later checkpoints it abandons, and trains on to
``--steps`` with neither spike nor NaN. It writes ``--out``: the steps it saved, the step it
resumed at, whether the weights it loaded were finite.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch

import ckptd.trainer
from tests.support.trainers.tiny_torch import build, save  # the drill's tiny trainer's

GO_TIMEOUT = 180.0


def resume(
    ckpt: Path, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, bool]:
    """Load ``name``; its step, and whether its weights are finite."""
    state = torch.load(ckpt / name / "state.pt", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    ckptd.trainer.report_resumed(ckpt / name, watch_dir=ckpt)
    step = int(state["step"])
    for later in ckpt.glob("step-*"):  # the abandoned line's, saved again from here on
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    return step, finite


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + GO_TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path.name} within the deadline")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--spike-at", type=int, default=0)
    p.add_argument("--nan-at", type=int, default=0)
    p.add_argument("--go", type=Path, default=None)
    # STEP:FILE: before step STEP, wait for FILE (the test says the saves before it have
    # committed: the target a spike protects does not depend on the machine's load).
    p.add_argument("--gate", action="append", default=[])
    p.add_argument("--resume", default="")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    model, optimizer = build(lr=0.05)
    step, finite = 0, True
    if args.resume:
        step, finite = resume(args.dir, args.resume, model, optimizer)
    else:
        ckptd.trainer.report_resumed(None, watch_dir=args.dir)
    start = step
    data = torch.Generator().manual_seed(step)
    saved, losses = [], {}
    gates = {int(at): Path(file) for at, _, file in (g.partition(":") for g in args.gate)}
    while step < args.steps:
        step += 1
        if step in gates:
            wait_for(gates[step])
        if step == args.spike_at:
            with torch.no_grad():
                model.weight.add_(30.0)
        if step == args.nan_at:
            with torch.no_grad():
                model.weight.fill_(math.nan)
        x = torch.randn(32, 8, generator=data)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=data)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.item()  # the loop's own sync, as a trainer logging its loss has
        losses[step] = value
        ckptd.trainer.report_step(step, args.dir, loss=value)
        if step % args.save_every == 0:
            save(args.dir / f"step-{step}", model, optimizer, step)
            saved.append(step)
        if step == args.spike_at and args.go is not None:
            wait_for(args.go)
        time.sleep(0.005)
    result = {"saved": saved, "resumed_at": start, "finite": finite}
    result.update({"last_loss": repr(losses.get(step)), "resumed_from": args.resume or None})
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
