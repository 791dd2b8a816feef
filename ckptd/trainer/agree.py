"""Make every rank of a job save at the same step.

A notice reaches the ranks at different moments: the daemon signals each process in
turn, a notice file is looked for every half second, and with many nodes the other
nodes' daemons learn of it one poll later. A sharded save (DCP, ZeRO, FSDP, the HF
Trainer's or Lightning's under DDP) is a collective: ranks that decide at different
steps never meet, and the job hangs until the deadline kills it.

``agree_to_save(flag)`` is an all-reduce (MAX) of each rank's own flag over the trainer's
process group: it returns True on every rank at the first step where any rank's flag is
True. It is a collective too, so every rank of the group must call it at every step
(where it decides), and all ranks then act on the same answer. Without
``torch.distributed`` initialised, or with one rank, it returns ``flag`` and costs
nothing. One call is one 1-element int32 all-reduce on the backend's device (CPU for
gloo, the current GPU for NCCL): cheap enough for every step.

This module never imports torch itself: when the trainer has not imported
``torch.distributed``, no process group can exist.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["agree_to_save"]

# Backends whose collectives take CPU tensors.
_CPU_BACKENDS = frozenset({"gloo", "mpi", "ucc"})


def _device_for(dist: Any, group: Any) -> Any:
    """Where a tensor for ``group``'s backend must live: CPU for gloo/MPI, else the current
    accelerator (NCCL: this process's current CUDA device)."""
    import torch

    backend = str(dist.get_backend(group))
    # A group created with several backends reads "cpu:gloo,cuda:nccl": the CPU one serves.
    if backend in _CPU_BACKENDS or backend.startswith("cpu:") or ",cpu:" in backend:
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        return torch.device(current.type, accelerator.current_device_index())
    return torch.device("cuda", torch.cuda.current_device())


def agree_to_save(flag: bool, group: Any = None) -> bool:
    """True on every rank of ``group`` (default: the whole job) when ``flag`` is True on
    any of them; every rank must call it at the same steps. Returns ``flag`` unchanged
    without an initialised process group of more than one rank."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return bool(flag)
    if dist.get_world_size(group) <= 1:
        return bool(flag)
    import torch

    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device_for(dist, group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return bool(tensor.item())
