"""One rank of the fleet campaign's job (bench/bench_fleet.py): PyTorch DDP over gloo on
CPU, one rank per node, saving with ``torch.distributed.checkpoint`` into its node-local dir.

The invariant: the weights after step ``n`` depend only on the config and ``n``, never on
where the run was interrupted. The model is built from the config with a fixed seed; the
batch of step ``n`` on rank ``r`` is drawn from a generator seeded by ``(seed, n, r)``
(no data position to carry); there is no dropout, and the torch RNG state is saved
anyway; AdamW's state and the step go into every checkpoint. So a resume from step ``S``
repeats steps ``S+1 ..`` exactly, and the final digest equals the uninterrupted run's.

Layout (as tests/support/trainers/cluster_dcp.py): every rank writes its DCP shard and
``rank-<r>.pt`` into ``<node-dir>/step-N/`` on its own node, the coordinator (global rank
0) writes ``.metadata`` last. A save is at every ``--save-every`` steps, and at the step
where any rank has ckptd's notice (``ckptd.trainer.preempted_on_any_rank``), after which
every rank stops. Resume from ``CKPTD_RESUME_FROM`` (``ckptd exec``, or the campaign's
blind restart) when set.

The log (``--log``, JSON lines, ``t`` = time.time()): ``start`` (``resumed_from``, 0 =
scratch), ``step`` after each optimizer step, ``save`` after each save returns, ``end``
with the SHA-256 of the final weights at the last step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ckptd.trainer
from tests.support.trainers.common import leave_without_teardown, load_sharded, save_sharded


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--node-dir", type=Path, required=True, help="this node's checkpoint root")
    p.add_argument("--log", type=Path, required=True, help="this attempt's JSON-lines log")
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=0, help="0: only on a notice")
    p.add_argument("--step-sleep", type=float, default=0.1, help="stands in for compute")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ballast-mib", type=int, default=0, help="extra MiB per rank per save")
    p.add_argument("--gloo-timeout", type=float, default=60.0)
    return p.parse_args()


class Log:
    """Appends one JSON object per line, flushed at once (the process may be killed)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = path.open("a", buffering=1)

    def write(self, kind: str, **fields: Any) -> None:
        self.fh.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")


def build(o: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(o.seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(o.features, o.hidden), torch.nn.Tanh()]
    for _ in range(max(0, o.layers - 2)):
        layers += [torch.nn.Linear(o.hidden, o.hidden), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(o.hidden, 1))
    return torch.nn.Sequential(*layers)


def batch(o: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed((o.seed * 1_000_003 + step) * 4099 + rank)
    x = torch.randn(o.batch, o.features, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def save(
    o: argparse.Namespace, rank: int, model: Any, optimizer: torch.optim.Optimizer, step: int
) -> Path:
    directory = o.node_dir / f"step-{step}"
    directory.mkdir(parents=True, exist_ok=True)
    if o.ballast_mib:
        with (directory / f"ballast-{rank}.bin").open("wb") as fh:
            for _ in range(o.ballast_mib):
                fh.write(os.urandom(1024 * 1024))
            fh.flush()
            os.fsync(fh.fileno())
    save_sharded(
        directory, rank, model, optimizer, {"step": step, "torch_rng": torch.get_rng_state()}
    )
    return directory


def load(directory: Path, rank: int, model: Any, optimizer: torch.optim.Optimizer) -> int:
    record = load_sharded(directory, rank, model, optimizer)
    torch.set_rng_state(record["torch_rng"])
    return int(record["step"])


def settle_buckets(model: Any, o: argparse.Namespace) -> None:
    """One backward pass whose gradients are thrown away (no optimizer step): DDP rebuilds
    its gradient buckets after a process's first backward, and with more than two ranks a
    gradient all-reduced in another bucket layout differs in its last bits. Every start
    (from scratch or resumed) settles the layout first, so step n is reduced alike in
    both."""
    model(torch.zeros(o.batch, o.features)).sum().backward()
    model.zero_grad(set_to_none=True)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    o = options()
    rank = int(os.environ["RANK"])
    ckptd.trainer.install(o.node_dir)  # before anything slow: the daemon may signal now
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    log = Log(o.log)
    dist.init_process_group("gloo", timeout=timedelta(seconds=o.gloo_timeout))
    net = build(o)
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    resume = ckptd.trainer.resume_from()
    if resume is not None:
        step = load(resume, rank, model, optimizer)
    settle_buckets(model, o)
    log.write("start", node=o.node, attempt=o.attempt, resumed_from=step)
    while step < o.steps:
        x, y = batch(o, step + 1, rank)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        step += 1
        if o.step_sleep:
            time.sleep(o.step_sleep)
        log.write("step", step=step)
        ckptd.trainer.report_step(step)
        preempted = ckptd.trainer.preempted_on_any_rank()  # the same answer on all ranks
        if (o.save_every and step % o.save_every == 0) or preempted:
            began = time.monotonic()
            saved = save(o, rank, model, optimizer, step)
            seconds = time.monotonic() - began
            ckptd.trainer.report_save(o.node_dir, checkpoint=saved.name, step=step, seconds=seconds)
            log.write("save", step=step, seconds=round(seconds, 4))
        if preempted:
            break
    if step == o.steps:
        log.write("end", step=step, digest=digest(net))
    dist.barrier()
    # Not destroy_process_group(): gloo's teardown can abort a rank whose peer left first.
    leave_without_teardown()


if __name__ == "__main__":
    main()
