"""Save and restore the *whole* training state in one call, so that a resumed run is
bit-identical to one that was never interrupted.

::

    from ckptd.trainer.state import ResumableSampler, load_training_state, save_training_state

    sampler = ResumableSampler(len(dataset), seed=1234)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler,     # num_workers=0
                        generator=torch.Generator().manual_seed(0))  # see below
    if resume_dir:
        saved = load_training_state(resume_dir, model=model, optimizer=opt, scheduler=sched)
        step = saved["step"]
        sampler.load_state_dict(saved["dataloader_state"])
    ...
    save_training_state(f"/data/ckpt/run1/step-{step}", model=model, optimizer=opt,
                        scheduler=sched, step=step, dataloader_state=sampler.state_dict())

What is saved: the model and optimizer through ``torch.distributed.checkpoint`` (DCP; a
single process needs no process group), and, in ``ckptd_train_state.pt``, the optimizer's
param groups, the LR scheduler, the RNG states of Python ``random``, NumPy (when
installed), torch CPU and every CUDA device, the step, the data-loader position and any
``extra`` the caller passes (plain types only: the file is read with ``weights_only``).

Completeness: ``ckptd_train_state.pt`` is written (and fsynced) *first*, the DCP save
*last*; DCP writes its ``.metadata`` after all shards, so a directory with ``.metadata``
holds everything. That is ckptd's ``dcp`` layout: the daemon ships the directory once
``.metadata`` appears.

Bit-identical resume also needs the loop itself to draw randomness the same way on both
paths. One trap found while proving it: every ``iter(DataLoader)`` draws a seed from the
*global* torch RNG unless the loader has its own ``generator=``; a resumed run makes its
first ``iter()`` mid-epoch, where the original did not, and drifts from then on. Give the
``DataLoader`` a ``generator`` (and use ``num_workers=0``, or track the position yourself).

This module imports torch lazily, in the functions, so ``ckptd.trainer`` needs no torch.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.trainer.resumed import report_resumed

if TYPE_CHECKING:
    import torch

__all__ = [
    "STATE_FILE",
    "ResumableSampler",
    "capture_rng_state",
    "load_training_state",
    "restore_rng_state",
    "save_training_state",
]

STATE_FILE = "ckptd_train_state.pt"
FORMAT_VERSION = 1


# -- RNG ----------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The RNG states of Python ``random``, NumPy (if importable), torch CPU and CUDA."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.array(keys, dtype=np.uint32)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned (parts absent here are skipped)."""
    import torch

    python = state["python"]
    # Saved as a tuple of (int, tuple of ints, float | None); weights_only may hand back lists.
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"])
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.set_state(
                (
                    numpy_state["kind"],
                    numpy_state["keys"].numpy(),
                    numpy_state["pos"],
                    numpy_state["has_gauss"],
                    numpy_state["cached_gaussian"],
                )
            )
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"checkpoint has CUDA RNG states for {len(cuda)} devices, "
                f"this node has {torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all(cuda)


# -- data-loader position -----------------------------------------------------------------


class ResumableSampler:
    """Indices ``0..length-1`` in a seeded permutation per epoch, resumable mid-epoch.

    Epoch ``e`` uses ``torch.randperm(length)`` from a generator seeded with ``seed + e``, so
    the order depends on nothing but (seed, epoch). The sampler counts what it has yielded;
    with ``DataLoader(num_workers=0)`` that is exactly what the training loop has consumed
    (with workers, the loader prefetches: pass the position yourself instead). After the
    last index of an epoch it moves to the next epoch on its own.

    ``state_dict()`` -> ``{"seed", "epoch", "offset"}``; ``load_state_dict`` skips ahead to it.
    It is a ``torch.utils.data.Sampler`` by duck typing (``__iter__`` and ``__len__``,
    which is always the whole epoch).
    """

    def __init__(self, length: int, *, seed: int = 0, epoch: int = 0, offset: int = 0) -> None:
        if length <= 0:
            raise ValueError("length must be positive")
        self.length = length
        self.seed = seed
        self.epoch = epoch
        self.offset = offset
        self._check()

    def _check(self) -> None:
        if not 0 <= self.offset <= self.length:
            raise ValueError(f"offset {self.offset} outside 0..{self.length}")

    def permutation(self, epoch: int) -> list[int]:
        """The order of epoch ``epoch``."""
        import torch

        generator = torch.Generator().manual_seed(self.seed + epoch)
        order: list[int] = torch.randperm(self.length, generator=generator).tolist()
        return order

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; for the current epoch, keep the position.

        Frameworks (Lightning, ``DistributedSampler`` users) call ``set_epoch`` at every
        epoch start, the resumed mid-epoch one included, which must not rewind it.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self.offset = 0

    def skip(self, count: int) -> None:
        """Skip ``count`` indices of the current epoch."""
        self.offset += count
        self._check()

    def __len__(self) -> int:
        # A whole epoch, even mid-epoch: loops that resume their batch counter (Lightning)
        # end the epoch by it, and would end a resumed epoch early on the remainder.
        return self.length

    def __iter__(self) -> Iterator[int]:
        order = self.permutation(self.epoch)
        while self.offset < self.length:
            index = order[self.offset]
            self.offset += 1
            yield index
        self.epoch += 1
        self.offset = 0

    def state_dict(self) -> dict[str, int]:
        """Where the next index comes from."""
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`)."""
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._check()


# -- save / load --------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def save_training_state(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    step: int,
    extra: dict[str, Any] | None = None,
    dataloader_state: dict[str, Any] | None = None,
) -> Path:
    """Save everything needed to resume at ``step`` into the directory ``path``.

    ``scheduler`` is anything with ``state_dict()`` (an LR scheduler). ``extra`` and
    ``dataloader_state`` must hold plain types (numbers, strings, lists, dicts, tensors).
    The directory must not hold an earlier checkpoint. Returns the directory.
    """
    import warnings

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / ".metadata").exists():
        raise FileExistsError(f"{directory} already holds a DCP checkpoint")
    model_state, optim_state = get_state_dict(model, optimizer)
    record = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "param_groups": optim_state["param_groups"],
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": capture_rng_state(),
        "dataloader_state": dataloader_state,
        "extra": extra,
    }
    # First the small file, fsynced; DCP's .metadata, written last, then vouches for it.
    state_file = directory / STATE_FILE
    torch.save(record, state_file)
    _fsync_file(state_file)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        _dcp().save(
            {"model": model_state, "optim": {"state": optim_state["state"]}},
            checkpoint_id=directory,
        )
    return directory


def load_training_state(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Load what :func:`save_training_state` saved into ``model``, ``optimizer``, ``scheduler``
    and the RNGs; return ``{"step", "extra", "dataloader_state"}``.

    Build the model, optimizer and scheduler exactly as for a fresh run first.
    Raises FileNotFoundError when ``path`` is not a complete checkpoint.
    """
    import warnings

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(path)
    if not (directory / ".metadata").is_file() or not (directory / STATE_FILE).is_file():
        raise FileNotFoundError(f"{directory} is not a complete ckptd training state")
    record = torch.load(directory / STATE_FILE, weights_only=True)
    if record.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory}: unknown training-state format {record.get('format')!r}")
    # get_state_dict initialises an optimizer that has not stepped yet, so its state has
    # the tensors DCP loads into in place.
    model_state, optim_state = get_state_dict(model, optimizer)
    target: dict[str, Any] = {"model": model_state, "optim": {"state": optim_state["state"]}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        _dcp().load(target, checkpoint_id=directory)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=target["model"],
        optim_state_dict={
            "state": target["optim"]["state"],
            "param_groups": record["param_groups"],
        },
    )
    if scheduler is not None:
        if record["scheduler"] is None:
            raise ValueError(f"{directory} holds no scheduler state")
        scheduler.load_state_dict(record["scheduler"])
    restore_rng_state(record["rng"])
    report_resumed(directory)  # the daemon's trajectory: a rollback starts a new one
    return {
        "step": int(record["step"]),
        "extra": record["extra"],
        "dataloader_state": record["dataloader_state"],
    }
