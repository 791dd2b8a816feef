"""One rank of a multi-node DeepSpeed ZeRO trainer on CPU (gloo), saving into its
*node-local* directory: ``<node-dir>/global_step<N>/`` gets this rank's
``zero_pp_rank_<r>_mp_rank_00_*`` files on every node, and rank 0 (node 0) writes
``mp_rank_00_model_states.pt`` and, after the barrier that ends the save, the ``latest``
tag file, so only node 0 holds the commit record.

Environment as torchrun sets it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Writes ``<out>/result-<rank>.json`` and, at the end, the full weights (rank 0).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch

from tests.support.trainers.common import leave_without_teardown, write_json


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--node-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--resume", type=Path, default=None, help="a restored global_step<N> dir")
    p.add_argument("--stage", type=int, default=2)
    return p.parse_args()


def main() -> None:
    o = options()
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": o.stage},
        "steps_per_print": 10**9,
    }
    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    step = 0
    if o.resume is not None:
        _, client = engine.load_checkpoint(str(o.resume.parent), tag=o.resume.name)
        step = int(client["step"])
    o.out.mkdir(parents=True, exist_ok=True)
    while step < o.steps:
        # Data drawn from (rank, step) alone, so a resumed run sees the same batches.
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True).tanh())
        engine.backward(loss)
        engine.step()
        step += 1
        if step % o.save_every == 0:
            # Every rank passes its own node's dir: its zero_pp_rank_* files land there,
            # rank 0's model states and `latest` (after the save's barrier) on node 0.
            engine.save_checkpoint(str(o.node_dir), client_state={"step": step})
    write_json(o.out / f"result-{rank}.json", {"step": step})
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if o.stage < 3 and rank == 0:
        torch.save(weights, o.out / "final.pt")
    # Every rank's files written, out without gloo's teardown (which can abort a rank whose
    # peer left first): exit 0 says the work is done.
    leave_without_teardown()


if __name__ == "__main__":
    main()
