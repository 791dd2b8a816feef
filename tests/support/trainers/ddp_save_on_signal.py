"""One rank of a two-rank job under a real ``torchrun`` (gloo, CPU) that saves when
asked: SIGUSR1 sets this rank's flag, the ranks agree by an all-reduce each step, rank 0
writes a Hugging Face-shaped checkpoint (``trainer_state.json`` last), all ranks meet
at a barrier and exit 0. ``<out>/rank<R>.ready`` marks a rank's handler installed.

    python -m torch.distributed.run --nproc-per-node 2 ddp_save_on_signal.py OUT
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ckptd.devtools.demo import toy_trainer_save

GIVE_UP_SECONDS = 120.0  # never outlive a test that forgot it


def main() -> int:
    root = Path(sys.argv[1])
    asked = {"save": False}
    signal.signal(signal.SIGUSR1, lambda *_: asked.update(save=True))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ready = root.parent / f"rank{rank}.ready"
    ready.with_suffix(".tmp").write_text(str(os.getpid()))
    ready.with_suffix(".tmp").replace(ready)  # whole, or not there
    step, deadline = 0, time.monotonic() + GIVE_UP_SECONDS
    while time.monotonic() < deadline:
        step += 1
        flag = torch.tensor([1 if asked["save"] else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank saves at the same step
        if flag.item():
            if rank == 0:
                toy_trainer_save(root, step, os.urandom(1 << 20))
            dist.barrier()
            dist.destroy_process_group()
            return 0
        time.sleep(0.05)
    dist.destroy_process_group()
    return 1


if __name__ == "__main__":
    sys.exit(main())
