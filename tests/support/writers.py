"""Write checkpoints the way each framework does, step by step, with random bytes.

Each writer yields after every step, so a test can look at the half-written state.
Orders (from the frameworks' save code):
- HF ``Trainer._save_checkpoint``: model + config, optimizer/scheduler, RNG state,
  then ``trainer_state.json`` last, straight into ``checkpoint-N/``.
- torch.distributed.checkpoint ``FileSystemWriter``: each rank's ``__R_0.distcp``,
  then the coordinator writes ``.metadata.tmp`` and renames it to ``.metadata``.
- DeepSpeed ``save_checkpoint``: ``global_stepN/`` model and optimizer states, then
  rank 0 writes the ``latest`` tag file beside it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def write_bytes(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return data


def hf_steps(root: Path, step: int, model_bytes: int = 1 << 20) -> Iterator[str]:
    d = root / f"checkpoint-{step}"
    write_bytes(d / "model.safetensors", model_bytes)
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    yield "model"
    write_bytes(d / "optimizer.pt", model_bytes // 2)
    write_bytes(d / "scheduler.pt", 1000)
    write_bytes(d / "rng_state.pth", 14000)
    yield "optimizer"
    (d / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    yield "trainer_state"


def write_hf(root: Path, step: int, model_bytes: int = 1 << 20) -> Path:
    for _ in hf_steps(root, step, model_bytes):
        pass
    return root / f"checkpoint-{step}"


def dcp_steps(
    root: Path, step: int, shard_bytes: int = 256 * 1024, ranks: int = 4
) -> Iterator[str]:
    d = root / f"step-{step}"
    for rank in range(ranks):
        write_bytes(d / f"__{rank}_0.distcp", shard_bytes)
    yield "shards"
    (d / ".metadata.tmp").write_bytes(os.urandom(3000))
    yield "metadata.tmp"
    os.rename(d / ".metadata.tmp", d / ".metadata")
    yield "metadata"


def write_dcp(root: Path, step: int, shard_bytes: int = 256 * 1024, ranks: int = 4) -> Path:
    for _ in dcp_steps(root, step, shard_bytes, ranks):
        pass
    return root / f"step-{step}"


def deepspeed_steps(root: Path, step: int, state_bytes: int = 512 * 1024) -> Iterator[str]:
    tag = f"global_step{step}"
    d = root / tag
    write_bytes(d / "mp_rank_00_model_states.pt", state_bytes)
    yield "model"
    write_bytes(d / "zero_pp_rank_0_mp_rank_00_optim_states.pt", state_bytes * 2)
    yield "optim"
    (root / "latest").write_text(tag)  # DeepSpeed writes the tag file in place
    yield "latest"


def write_deepspeed(root: Path, step: int, state_bytes: int = 512 * 1024) -> Path:
    for _ in deepspeed_steps(root, step, state_bytes):
        pass
    return root / f"global_step{step}"


def local_files(checkpoint_dir: Path) -> dict[str, bytes]:
    """Every file of a local checkpoint, by '/'-relative path."""
    out = {}
    for path in sorted(checkpoint_dir.rglob("*")):
        if path.is_file():
            out[path.relative_to(checkpoint_dir).as_posix()] = path.read_bytes()
    return out
