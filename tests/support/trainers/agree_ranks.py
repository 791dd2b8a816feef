"""One rank of a plain PyTorch loop over torch.distributed (gloo) that saves a DCP
checkpoint when the ranks agree to, through ``ckptd.trainer.agree_to_save``.

Launched like torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, NODE_RANK in
the environment). Each rank's own flag is "a SIGUSR1 arrived since my last save": the
test signals one rank of one node at a random instant, the others see nothing. Every
save is a collective DCP save into this node's own ``<work>/node-<k>/run/step-<N>``
(rank 0 writes ``.metadata`` on node 0 only), so ranks that disagreed would never meet.
Each save appends ``{"round", "step", "first_local"}`` to ``<work>/rank-<r>.jsonl``:
``first_local`` is the step at which this rank's own flag first was up (None: never).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptd.trainer
from tests.support.trainers.common import leave_without_teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--max-steps", type=int, default=200_000)
    options = parser.parse_args()
    rank = int(os.environ["RANK"])
    node = int(os.environ["NODE_RANK"])

    pending = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal pending
        pending = True  # a flag only; the loop acts at its next step

    signal.signal(signal.SIGUSR1, on_signal)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    report = options.work / f"rank-{rank}.jsonl"
    (options.work / f"rank-{rank}.pid").write_text(str(os.getpid()))

    step = 0
    done = 0
    first_local: int | None = None
    while done < options.rounds and step < options.max_steps:
        step += 1
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()
        time.sleep(0.002)  # stands in for the rest of a real step
        local = pending
        if local and first_local is None:
            first_local = step
        if ckptd.trainer.agree_to_save(local):
            pending = False  # before the report: the test signals again only after it
            path = options.work / f"node-{node}" / "run" / f"step-{step}"
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=UserWarning)
                dcp.save(
                    {"model": model.state_dict()},
                    storage_writer=dcp.FileSystemWriter(path),
                )
            with report.open("a") as out:
                out.write(json.dumps({"round": done, "step": step, "first_local": first_local}))
                out.write("\n")
            first_local = None
            done += 1
    leave_without_teardown()


if __name__ == "__main__":
    main()
