"""One rank of a real torch.distributed (gloo) job that counts what ``agree_any`` and the
HF and Lightning callbacks send per step, for ``tests/e2e/test_agree_cost.py``.

Launched like torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every
collective function of ``torch.distributed`` (the names in ``COLLECTIVES``) and
``new_group`` are wrapped to record each call with its tensors' devices and whether it
went over the default group; ``torch.cuda`` / ``torch.accelerator`` calls that sync or
pick a device are wrapped to record and raise. With ``--pretend-backend nccl`` the
default group reports that backend to ckptd (``torch.distributed.get_backend`` only; the
group is gloo underneath, so no CUDA is needed): the path a GPU job takes.

Scenarios, in the same order on every rank, each a list of per-step records written to
``<out>``: ``agree`` (one flag, up on rank 1 at step 3), ``agree_two`` (two flags),
``lightning`` (``CkptdLightningCallback(follow_advice=True)``, no notice, no advice: the
old code sent two all-reduces here), ``hf`` (``CkptdCallback(follow_advice=True)``; rank
1 signals itself SIGUSR1 before step 3: every rank must fire at step 3).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.support.trainers.common import leave_without_teardown

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)
DEVICE_CALLS = (
    (torch.cuda, "synchronize"),
    (torch.cuda, "current_device"),
    (torch.cuda, "set_device"),
    (torch.accelerator, "synchronize"),
    (torch.accelerator, "current_device_index"),
)

calls: list[dict[str, Any]] = []
device_calls: list[str] = []
new_groups: list[str] = []


def _devices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    found = []
    for value in [*args, *kwargs.values()]:
        items = value if isinstance(value, list | tuple) else [value]
        found += [str(v.device) for v in items if isinstance(v, torch.Tensor)]
    return found


def _wrap_collective(name: str) -> None:
    original = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        default = group is None or group is dist.group.WORLD
        calls.append({"name": name, "devices": _devices(args, kwargs), "default": default})
        return original(*args, **kwargs)

    setattr(dist, name, counted)


def _wrap_device_call(module: Any, name: str) -> None:
    def refused(*args: Any, **kwargs: Any) -> Any:
        device_calls.append(f"{module.__name__}.{name}")
        raise RuntimeError(f"{module.__name__}.{name} called: a device synchronisation")

    setattr(module, name, refused)


def instrument(pretend_backend: str | None) -> None:
    for name in COLLECTIVES:
        _wrap_collective(name)
    for module, name in DEVICE_CALLS:
        _wrap_device_call(module, name)
    real_new_group = dist.new_group

    def counted_new_group(*args: Any, **kwargs: Any) -> Any:
        new_groups.append(str(kwargs.get("backend")))
        return real_new_group(*args, **kwargs)

    dist.new_group = counted_new_group
    if pretend_backend:
        real_get_backend = dist.get_backend

        def get_backend(group: Any = None) -> str:
            if group is None or group is dist.group.WORLD:
                return pretend_backend
            return str(real_get_backend(group))

        dist.get_backend = get_backend


def step(records: list[dict[str, Any]], action: Callable[[], Any]) -> None:
    before = len(calls)
    answer = action()
    made = calls[before:]
    records.append(
        {
            "collectives": len(made),
            "devices": sorted({d for c in made for d in c["devices"]}),
            "over_default_group": sum(c["default"] for c in made),
            "answer": answer,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--watch", type=Path, required=True)
    parser.add_argument("--pretend-backend", default=None)
    parser.add_argument("--steps", type=int, default=5)
    options = parser.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    instrument(options.pretend_backend)

    import ckptd.trainer
    from ckptd.trainer.agree import agree_any

    ckptd.trainer.install(options.watch)
    scenarios: dict[str, list[dict[str, Any]]] = {"agree": [], "agree_two": []}
    for n in range(1, options.steps + 1):
        flag = rank == 1 and n == 3
        step(scenarios["agree"], lambda f=flag: list(agree_any(f)))
    for n in range(1, options.steps + 1):
        flags = (rank == 0 and n == 2, rank == 1 and n >= 4)
        step(scenarios["agree_two"], lambda f=flags: list(agree_any(*f)))

    from ckptd.trainer.lightning import CkptdLightningCallback

    lightning = CkptdLightningCallback(options.watch, watch_dir=options.watch, follow_advice=True)
    scenarios["lightning"] = []
    for n in range(options.steps):
        # Neither flag: the trainer is read for its step only (no save), so a stand-in
        # holding ``global_step`` is all that is built here.
        at = SimpleNamespace(global_step=n)
        step(
            scenarios["lightning"],
            lambda at=at, n=n: lightning.on_train_batch_end(at, None, None, None, n),  # type: ignore[arg-type]
        )

    from transformers import TrainerControl, TrainerState

    from ckptd.trainer.hf import CkptdCallback

    hf = CkptdCallback(options.watch, follow_advice=True)
    state, control = TrainerState(), TrainerControl()
    scenarios["hf"] = []
    for n in range(1, options.steps + 1):
        state.global_step = n
        if rank == 1 and n == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # the daemon's signal, to this rank only
        step(
            scenarios["hf"],
            lambda: hf.on_step_end(None, state, control) or hf.fired_at_step,  # type: ignore[arg-type, func-returns-value]
        )
    result = {
        "rank": rank,
        "scenarios": scenarios,
        "new_groups": new_groups,
        "device_calls": device_calls,
        "hf_should_save": control.should_save,
    }
    options.out.write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()
