"""A CPU-bound stand-in trainer with a data loader that reads through the page cache.

    python bench/_interference_trainer.py --dataset FILE --out STEPS.jsonl --stop FILE
        [--batch-mib 4] [--work-ms 40] [--seed 0]

Each step reads one batch (``pread`` of ``--batch-mib`` at a batch-aligned offset, the
batches of an epoch in a seeded random order) and then does ``--work-ms`` of pure CPU
work (SHA-256 rounds over the batch, calibrated once at start). Before the read it asks
the kernel which of the batch's pages are cached (``mincore`` on a read-only mapping of
the dataset, which touches nothing), so each step records its page-cache hit rate.

One JSON line per step: ``t`` (Unix start), ``dt`` (seconds), ``hit`` (fraction of the
batch's pages in the page cache before the read), ``epoch``. Stops when ``--stop``
exists.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import hashlib
import json
import mmap
import os
import random
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class Residency:
    """``mincore`` over a PROT_READ mapping of a file: which pages are cached."""

    def __init__(self, fd: int, size: int) -> None:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.addr = int(addr)

    def fraction(self, offset: int, length: int) -> float:
        pages = (length + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(self.addr + offset), length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec) / pages


def _work(buf: bytes, rounds: int) -> bytes:
    digest = b""
    for _ in range(rounds):
        digest = hashlib.sha256(buf).digest()
    return digest


def _calibrate(buf: bytes, target_s: float) -> int:
    """SHA-256 rounds over ``buf`` that take ``target_s`` here (best of 5 trials)."""
    best = min(_timed(buf) for _ in range(5))
    return max(1, round(target_s / best))


def _timed(buf: bytes) -> float:
    started = time.perf_counter()
    _work(buf, 1)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--batch-mib", type=int, default=4)
    parser.add_argument("--work-ms", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    batch = args.batch_mib * 1024 * 1024
    fd = os.open(args.dataset, os.O_RDONLY)
    size = os.fstat(fd).st_size
    residency = Residency(fd, size)
    batches = size // batch
    rounds = _calibrate(os.urandom(batch), args.work_ms / 1000)
    rng = random.Random(args.seed)
    epoch = 0
    with args.out.open("a") as out:
        out.write(json.dumps({"calibrated_rounds": rounds, "batches": batches}) + "\n")
        while not args.stop.exists():
            order = list(range(batches))
            rng.shuffle(order)
            for index in order:
                if args.stop.exists():
                    break
                offset = index * batch
                started_unix, started = time.time(), time.perf_counter()
                hit = residency.fraction(offset, batch)
                data = os.pread(fd, batch, offset)
                _work(data, rounds)
                dt = time.perf_counter() - started
                out.write(
                    json.dumps({"t": started_unix, "dt": dt, "hit": hit, "epoch": epoch}) + "\n"
                )
                out.flush()
            epoch += 1


if __name__ == "__main__":
    main()
