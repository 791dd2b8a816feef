"""One rank of a multi-node FSDP2 trainer over gloo that saves with
``torch.distributed.checkpoint`` into its *node-local* directory.

Started once per rank (RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT in
the environment, as torchrun sets them). ``--node-dir`` is this node's checkpoint root, the
dir its daemon watches: rank ``r`` writes ``__r_0.distcp`` into ``<node-dir>/step-N/``, and
the DCP coordinator (global rank 0, on node 0) writes ``.metadata`` there last, so only
node 0 ever holds the commit record — the layout that needs ckptd's many-node protocol.

The model is sharded (``fully_shard``: every parameter and AdamW moment is a DTensor split
across the four ranks), so no node holds the whole state. Each rank also writes
``rank-<r>.pt`` (its data and dropout RNG, the LR scheduler, the step) before the DCP save;
``.metadata``, written after every rank's files, vouches for them.

Resume (``--resume DIR``, a node-local directory holding the *whole* checkpoint, as
``ckptd restore`` puts it there) loads the shards through DCP, which reads shards written by
other ranks, and the rank file of this rank. The ranks agree on the preemption step with
``ckptd.trainer.preempted_on_any_rank()`` (an all-reduce of the local flag), so every rank
saves the same step.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.fsdp import fully_shard

import ckptd.trainer
from tests.support.trainers.common import (
    hang_forever,
    leave_without_teardown,
    load_sharded,
    save_sharded,
    write_json,
)

FEATURES = 16
HIDDEN = 64


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--node-dir", type=Path, required=True, help="this node's checkpoint root")
    p.add_argument("--out", type=Path, required=True, help="progress/result files of the ranks")
    p.add_argument("--final", type=Path, required=True, help="full weights at max steps (rank 0)")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--resume", type=Path, default=None, help="the restored checkpoint dir")
    p.add_argument("--hang-at", type=int, default=0, help="every rank blocks after this step")
    p.add_argument("--step-delay", type=float, default=0.0, help="stands in for real compute")
    p.add_argument(
        "--ballast-mib",
        type=int,
        default=0,
        help="each rank's save also writes this many MiB (a node's share of a large model)",
    )
    return p.parse_args()


def build(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)  # the same initial weights on every rank, then sharded
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    torch.manual_seed(100 + rank)  # this rank's dropout stream
    return model, optimizer, scheduler


def save(
    directory: Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: torch.Generator,
    step: int,
    ballast_mib: int = 0,
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if ballast_mib:
        # Stands in for the bulk of a real model's shard: written before DCP's .metadata,
        # which vouches for it as for every rank's files.
        with (directory / f"ballast-{rank}.bin").open("wb") as fh:
            for _ in range(ballast_mib):
                fh.write(os.urandom(1024 * 1024))
            fh.flush()
            os.fsync(fh.fileno())
    record = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "data_rng": data.get_state(),
        "torch_rng": torch.get_rng_state(),
    }
    # Each rank passes its own node's path: the writer puts this rank's shard there, and
    # the coordinator's .metadata lands on node 0 only.
    save_sharded(directory, rank, model, optimizer, record)


def load(
    directory: Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: torch.Generator,
) -> int:
    record = load_sharded(directory, rank, model, optimizer)
    scheduler.load_state_dict(record["scheduler"])
    data.set_state(record["data_rng"])
    torch.set_rng_state(record["torch_rng"])
    return int(record["step"])


def main() -> None:
    o = options()
    rank = int(os.environ["RANK"])
    ckptd.trainer.install(o.node_dir)  # before anything slow: the daemon may signal now
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo")
    o.out.mkdir(parents=True, exist_ok=True)
    progress = o.out / f"progress-{rank}.json"

    model, optimizer, scheduler = build(rank)
    data = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.Generator().manual_seed(7)
    true_w = torch.randn(FEATURES, 1, generator=teacher)

    step = 0
    if o.resume is not None:
        step = load(o.resume, rank, model, optimizer, scheduler, data)
    resumed_from = step
    first_step_at: float | None = None
    saved: str | None = None
    preempted = False
    while step < o.max_steps:
        x = torch.randn(8, FEATURES, generator=data)
        y = (x @ true_w).tanh()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        scheduler.step()
        step += 1
        if o.step_delay:
            time.sleep(o.step_delay)
        first_step_at = first_step_at or time.time()
        write_json(
            progress, {"step": step, "resumed_from": resumed_from, "first_step_at": first_step_at}
        )
        preempted = ckptd.trainer.preempted_on_any_rank()  # the same answer on all ranks
        if step % o.save_every == 0 or preempted:
            save(
                o.node_dir / f"step-{step}",
                rank,
                model,
                optimizer,
                scheduler,
                data,
                step,
                o.ballast_mib,
            )
            saved = f"step-{step}"
        if preempted:
            break
        if step == o.hang_at:
            hang_forever()

    if step == o.max_steps:
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save(full, o.final)
    dist.barrier()
    write_json(
        o.out / f"result-{rank}.json", {"step": step, "saved": saved, "preempted": preempted}
    )
    # Not destroy_process_group(): gloo's teardown can abort a rank whose peer left first
    # (exit -6 with every result written), which the cluster tests would read as a crash.
    leave_without_teardown()


if __name__ == "__main__":
    main()
