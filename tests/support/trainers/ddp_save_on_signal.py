"""One rank of a two-rank job under a real ``torchrun`` (gloo, CPU) that saves when
asked: SIGUSR1 sets this rank's flag, the ranks agree by an all-reduce each step, rank 0
writes a Hugging Face-shaped checkpoint (``trainer_state.json`` last), all ranks meet
at a barrier and exit 0 without tearing gloo down (its teardown can abort a rank whose
peer left first: see ``leave_without_teardown``). ``<out>/rank<R>.ready`` marks a rank's
handler installed; a rank never asked gives up after ``GIVE_UP_SECONDS`` and exits 1.

    python -m torch.distributed.run --nproc-per-node 2 ddp_save_on_signal.py OUT
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from ckptd.devtools.demo import toy_trainer_save

# torchrun runs this file by path, so its directory, not the repo's root, heads sys.path:
# the root goes first for the shared exit below.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.support.trainers.common import leave_without_teardown

GIVE_UP_SECONDS = 120.0  # never outlive a test that forgot it


def main() -> NoReturn:
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
            leave_without_teardown()  # every rank at the barrier, then exit 0
        time.sleep(0.05)
    # Given up: no barrier (a peer may be gone) and no teardown, just the failure.
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
    main()
