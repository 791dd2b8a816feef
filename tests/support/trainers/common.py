"""What every lossless-resume trainer script shares: its command line, its progress
reports, determinism, the "node dies here" hang, and a multi-rank script's exit."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

import ckptd.trainer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True, help="the dir the daemon watches")
    p.add_argument("--pidfile", type=Path, required=True)
    p.add_argument("--progress", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--final", type=Path, required=True, help="final weights, at max steps")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    # Under `ckptd exec`, the checkpoint it names: the one line a trainer needs.
    p.add_argument(
        "--resume",
        type=Path,
        default=ckptd.trainer.resume_from(),
        help="a restored checkpoint (default: CKPTD_RESUME_FROM)",
    )
    p.add_argument("--hang-at", type=int, default=0, help="block after this step (kill -9 me)")
    p.add_argument(
        "--hang-once-at",
        type=int,
        action="append",
        default=[],
        help="block after this step, the first time any run of the script reaches it "
        "(a mark in --hang-marks says it did)",
    )
    p.add_argument("--hang-marks", type=Path, default=None, help="where --hang-once-at marks")
    p.add_argument(
        "--pause-at", type=int, default=0, help="after this step, wait for the notice (<= 60 s)"
    )
    p.add_argument("--step-delay", type=float, default=0.0, help="stands in for real compute")
    # bench/gpu_check.py: the same trainer on a GPU, and without ckptd at all (no listener,
    # no callback) as the baseline of its step time.
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--without-ckptd", action="store_true", help="no ckptd.trainer at all")
    p.add_argument(
        "--report-saves", action="store_true", help="report each save's time (saves.jsonl)"
    )
    return p


def deterministic() -> None:
    """The settings under which two runs of the same steps are bit-identical (on CUDA
    too: cuBLAS needs its workspace fixed before it starts)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(1)


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Reporter:
    """Writes ``{"step", "first_step_at", "resumed_from"}`` after every finished step, and
    keeps each step's end (``time.perf_counter``) in ``ends`` for step times."""

    def __init__(self, path: Path, resumed_from: int) -> None:
        self.path = path
        self.resumed_from = resumed_from
        self.first_step_at: float | None = None
        self.ends: list[float] = []

    def step_done(self, step: int) -> None:
        self.ends.append(time.perf_counter())
        now = time.time()
        if self.first_step_at is None:
            self.first_step_at = now
        # The trainer's own log (the goodput test counts re-done steps from it), and
        # its step report to ckptd (a no-op unless CKPTD_WATCH_DIR is set).
        with self.path.with_suffix(".steps").open("a") as log:
            log.write(f"{os.getpid()} {step} {now:.6f}\n")
        ckptd.trainer.report_step(step)
        write_json(
            self.path,
            {"step": step, "first_step_at": self.first_step_at, "resumed_from": self.resumed_from},
        )


def pause_until_noticed(timeout: float = 60.0) -> None:
    """Hold still until ckptd's notice is seen, so a notice lands at a known step however
    slow its delivery on a loaded machine; the trainer then saves and stops as ever."""
    deadline = time.monotonic() + timeout
    while not ckptd.trainer.preempted() and time.monotonic() < deadline:
        time.sleep(0.01)


def cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights as CPU tensors: the final weights of a GPU run load anywhere."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def save_sharded(
    directory: Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    record: dict[str, Any],
) -> None:
    """A many-rank save into this rank's node-local ``directory``: its own ``record``
    (step, RNGs, ...) as ``rank-<rank>.pt``, fsynced, then model and optimizer through
    DCP, which writes this rank's shard there and the coordinator's ``.metadata`` last."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank_file = directory / f"rank-{rank}.pt"
    torch.save(record, rank_file)
    with rank_file.open("rb") as fh:
        os.fsync(fh.fileno())
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)


def load_sharded(
    directory: Path, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """What ``save_sharded`` saved: model and optimizer loaded through DCP (from every
    rank's shards), and this rank's record returned."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    target = {"model": model_state, "optim": optim_state}
    dcp.load(target, checkpoint_id=directory)
    set_state_dict(
        model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
    return dict(torch.load(directory / f"rank-{rank}.pt", weights_only=True))


def first_time_here(marks: Path | None, step: int) -> bool:
    """Whether no run of this script reached ``step`` before (a mark per step in
    ``marks``, made now, exclusively): ``--hang-once-at`` hangs each attempt that gets
    there first, and lets its successors, which redo the step, pass."""
    if marks is None:
        return False
    marks.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marks / f"hung-at-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def hang_forever() -> None:
    """The node froze: nothing more happens until the test kill -9s this process."""
    threading.Event().wait()


def leave_without_teardown() -> NoReturn:
    """End a rank once its results are written: every rank done before any leaves, then
    out without tearing gloo down. A rank whose peer closed first can abort in gloo's
    teardown ("terminate called without an active exception", exit 134: seen on a
    loaded machine, pytorch/pytorch#190489), which says nothing about the work."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
