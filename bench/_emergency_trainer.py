"""A stand-in trainer for ``bench_preemption.py``: saves an HF-shaped checkpoint when told.

    python bench/_emergency_trainer.py --dir WATCH --pidfile PID --mib N --result FILE
        [--report]

Like ``tests/support/trainers/toy_preemptible.py``, but sized and timed:

1. generates ``N`` MiB of random bytes in memory first (so generating them is never timed
   as "trainer save"), then ``ckptd.trainer.install(WATCH)`` (the signal handler) and
   only then writes ``PID``; ``WATCH/.ready`` says it is training;
2. "trains" in 10 ms steps until ``ckptd.trainer.preempted()``;
3. writes ``WATCH/checkpoint-<step>/`` as ``transformers.Trainer`` does (weights, config,
   optimizer, scheduler, RNG state, ``trainer_state.json`` last), each file fsynced, then
   the directory; with ``--report``, then ``ckptd.trainer.report_save`` (as the HF
   callback's ``on_save`` does);
4. writes ``FILE``: JSON with ``CLOCK_MONOTONIC`` nanoseconds at which it saw the notice,
   began and finished the save, the checkpoint's name and size; exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import ckptd.trainer

MIB = 1024 * 1024
CHUNK = 64 * MIB


def random_chunks(size: int) -> list[bytes]:
    """``size`` random bytes as chunks of at most 64 MiB."""
    chunks = []
    left = size
    while left:
        n = min(CHUNK, left)
        chunks.append(os.urandom(n))
        left -= n
    return chunks


def write_file(path: Path, chunks: list[bytes]) -> int:
    """Write and fsync; returns the bytes written."""
    written = 0
    with path.open("wb") as f:
        for chunk in chunks:
            f.write(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return written


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--pidfile", type=Path, required=True)
    parser.add_argument("--mib", type=float, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--report", action="store_true", help="report the save to the daemon")
    options = parser.parse_args()

    total = max(1, int(options.mib * MIB))
    # The shape of common.hf_shape: weights 2/3, optimizer state 1/3, small files beside.
    model_bytes = total * 2 // 3
    weights = random_chunks(model_bytes)
    optimizer = random_chunks(total - model_bytes)
    small = {
        "config.json": json.dumps({"model_type": "bench", "hidden_size": 4096}).encode(),
        "scheduler.pt": os.urandom(1_064),
        "rng_state.pth": os.urandom(14_244),
    }

    ckptd.trainer.install(options.dir)  # before the pidfile: the daemon may signal from then on
    tmp = options.pidfile.with_name(f".{options.pidfile.name}.tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, options.pidfile)
    (options.dir / ".ready").write_text(str(os.getpid()))

    step = 0
    while not ckptd.trainer.preempted():
        step += 1
        time.sleep(0.01)
    seen_ns = time.monotonic_ns()

    target = options.dir / f"checkpoint-{step}"
    target.mkdir()
    written = write_file(target / "model.safetensors", weights)
    written += write_file(target / "config.json", [small["config.json"]])
    written += write_file(target / "optimizer.pt", optimizer)
    written += write_file(target / "scheduler.pt", [small["scheduler.pt"]])
    written += write_file(target / "rng_state.pth", [small["rng_state.pth"]])
    state = json.dumps({"global_step": step, "emergency": True}).encode()
    written += write_file(target / "trainer_state.json", [state])  # last, as the Trainer does
    fsync_dir(target)
    saved_ns = time.monotonic_ns()
    if options.report:
        seconds = (saved_ns - seen_ns) / 1e9
        ckptd.trainer.report_save(options.dir, checkpoint=target.name, step=step, seconds=seconds)

    result = {
        "checkpoint": target.name,
        "bytes": written,
        "seen_ns": seen_ns,
        "save_start_ns": seen_ns,
        "save_end_ns": saved_ns,
        "steps": step,
    }
    tmp_result = options.result.with_name(f".{options.result.name}.tmp")
    tmp_result.write_text(json.dumps(result))
    os.replace(tmp_result, options.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
