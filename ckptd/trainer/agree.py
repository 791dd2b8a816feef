"""Make every rank of a job save at the same step, without stalling the GPU.

A notice reaches the ranks at different moments: the daemon signals each process in
turn, a notice file is looked for every half second, and with many nodes the other
nodes' daemons learn of it one poll later. A sharded save (DCP, ZeRO, FSDP, the HF
Trainer's or Lightning's under DDP) is a collective: ranks that decide at different
steps never meet, and the job hangs until the deadline kills it.

``agree_any(*flags)`` is one all-reduce (MAX) of each rank's flags, all of them in one
int32 tensor, over the trainer's process group: flag ``i`` comes back True on every rank
at the first step where any rank's flag ``i`` is True. ``agree_to_save(flag)`` is the
one-flag case. It is a collective too, so every rank of the group must call it at every
step (where it decides), and all ranks then act on the same answer. Without
``torch.distributed`` initialised, or with one rank, the flags come back unchanged and
nothing is sent.

Invariant: one call is one collective on a CPU tensor, never a device synchronisation.
A group whose backend takes CPU tensors (gloo, MPI, UCC, or a mixed ``cpu:gloo,cuda:nccl``
group) is used as it is. For any other (NCCL) a gloo *side group* over the same ranks is
made at the first call, which every rank of the group reaches together (the
agreement is a collective already), and reused: reading an NCCL result back (``.item()``)
would stall the CPU until the GPU had drained its queue, at every step. Where no gloo
group can be made (torch built without gloo, or its creation fails), the agreement runs
over the trainer's own group on its device, as before the side group: still one
collective per call, but one device synchronisation too; a warning says so once.

This module never imports torch itself: when the trainer has not imported
``torch.distributed``, no process group can exist.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["agree_any", "agree_to_save"]

log = logging.getLogger("ckptd.trainer")

# Backends whose collectives take CPU tensors.
_CPU_BACKENDS = frozenset({"gloo", "mpi", "ucc"})


@dataclass(frozen=True)
class _Route:
    """Where one process group's agreement goes: ``group`` (None: the default group) and
    whether its tensor lives on the CPU (False only on the fallback)."""

    group: Any
    on_cpu: bool


# The caller's group (the default group's own object for None) -> its route. A process
# group re-made after destroy_process_group is a new object, hence a new entry.
_routes: dict[Any, _Route] = {}
_routes_lock = threading.Lock()


def _serves_cpu(backend: str) -> bool:
    # A group created with several backends reads "cpu:gloo,cuda:nccl": the CPU one serves.
    return backend in _CPU_BACKENDS or backend.startswith("cpu:") or ",cpu:" in backend


def _device_for(dist: Any, group: Any) -> Any:
    """Where a tensor for ``group``'s own backend must live: CPU for gloo/MPI, else the
    current accelerator (NCCL: this process's current CUDA device). Only the fallback
    puts one anywhere but the CPU."""
    import torch

    if _serves_cpu(str(dist.get_backend(group))):
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        return torch.device(current.type, accelerator.current_device_index())
    return torch.device("cuda", torch.cuda.current_device())


def _side_group(dist: Any, group: Any) -> Any:
    """A new gloo group over ``group``'s ranks (a collective of those ranks); None, with
    one warning, where none can be made."""
    backend = dist.get_backend(group)
    why = ""
    if not dist.is_gloo_available():
        why = "this torch is built without gloo"
    else:
        try:
            if group is None:
                return dist.new_group(backend="gloo")
            # Only the members call in (the agreement is theirs alone): a local barrier.
            ranks = dist.get_process_group_ranks(group)
            return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        except (RuntimeError, ValueError) as exc:
            why = f"creating it failed: {exc}"
    log.warning(
        "ckptd: no gloo side group for the %s process group (%s); the ranks agree over "
        "that group itself, which costs one device synchronisation per step",
        backend,
        why,
    )
    return None


def _route(dist: Any, group: Any) -> _Route:
    key = group if group is not None else dist.group.WORLD
    with _routes_lock:
        route = _routes.get(key)
        if route is None:
            if _serves_cpu(str(dist.get_backend(group))):
                route = _Route(group, on_cpu=True)
            else:
                side = _side_group(dist, group)
                route = _Route(side, on_cpu=True) if side is not None else _Route(group, False)
            _routes[key] = route
        return route


def agree_any(*flags: bool, group: Any = None) -> tuple[bool, ...]:
    """Each flag OR-ed over every rank of ``group`` (default: the whole job), in one
    collective; every rank must call it at the same steps with as many flags. Returns
    the flags unchanged without an initialised process group of more than one rank."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return tuple(bool(f) for f in flags)
    if dist.get_world_size(group) <= 1:
        return tuple(bool(f) for f in flags)
    import torch

    route = _route(dist, group)
    device = torch.device("cpu") if route.on_cpu else _device_for(dist, group)
    tensor = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=route.group)
    # On the CPU this reads memory; only the fallback's device tensor synchronises.
    return tuple(bool(v) for v in tensor.tolist())


def agree_to_save(flag: bool, group: Any = None) -> bool:
    """True on every rank of ``group`` (default: the whole job) when ``flag`` is True on
    any of them; every rank must call it at the same steps. Returns ``flag`` unchanged
    without an initialised process group of more than one rank."""
    (agreed,) = agree_any(flag, group=group)
    return agreed
