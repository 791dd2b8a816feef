"""The CPU price of authenticated checkpoints: the file digest against the CRC-32C alone.

    .venv/bin/python bench/bench_digest.py                    # 1 GiB, median of 3
    .venv/bin/python bench/bench_digest.py --size-mib 256 --runs 1

Part 1, the candidates in native code on 1 MiB blocks (what ckptd hashes): SHA-256
(hashlib, OpenSSL) and BLAKE3 (the ``blake3`` package, Rust), CPU-seconds per GiB on one
thread, and the throughput of two threads (both release the GIL on a buffer this size).

Part 2, ckptd's own code paths in this process, all in one run: the sync pipeline ships a
checkpoint of one ``--size-mib`` file (multipart, 64 MiB parts) to a ``file://``
destination, without and with ``[authentication]`` (the digest is computed in the read
pass of the CRC-32C), and ``restore`` brings it back without and with a key (the digest
of every ranged GET's bytes, as they are written). The figure is the process's CPU time
(all threads) per GiB, median of ``--runs``, the modes interleaved. Source, store and
target live under ``--dir`` (default /dev/shm: disk time is not what is measured).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import secrets
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common

from blake3 import blake3
from common import GIB, MIB, machine_line

from ckptd.config import load_settings
from ckptd.core.signing import KeyRing
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_destination
from ckptd.store.restore import RestoreRequest, restore
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline

RUN = "bench"


def cpu_per_gib(fn: Callable[[], None], nbytes: int) -> float:
    started = time.process_time()
    fn()
    return (time.process_time() - started) / (nbytes / GIB)


def native(total_mib: int) -> list[tuple[str, float, float]]:
    """(name, CPU-s/GiB on one thread, MiB/s wall on two threads) per algorithm."""
    block = os.urandom(MIB)
    algorithms: dict[str, Callable[[bytes], bytes]] = {
        "SHA-256 (hashlib/OpenSSL)": lambda b: hashlib.sha256(b).digest(),
        "BLAKE3 (blake3, Rust)": lambda b: blake3(b).digest(),
    }
    rows = []
    for name, h in algorithms.items():

        def one(h: Callable[[bytes], bytes] = h, n: int = total_mib) -> None:
            for _ in range(n):
                h(block)

        cpu = statistics.median(cpu_per_gib(one, total_mib * MIB) for _ in range(3))
        threads = [threading.Thread(target=one, args=(h, total_mib // 2)) for _ in range(2)]
        wall = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append((name, cpu, total_mib / (time.perf_counter() - wall)))
    return rows


def ship(root: Path, name: str, key: Path | None) -> Path:
    """Ship checkpoint ``name`` (already under root/watch) with the real pipeline."""
    state = root / f"state-{name}"
    state.mkdir()
    settings = load_settings(
        overrides={
            "watch": [
                {"dir": str(root / "watch"), "run_id": RUN, "layout": "marker", "ship_early": False}
            ],
            "destination": {"url": f"file://{root / 'store'}", "concurrency": 4},
            "state": {"dir": str(state)},
            "retention": {"keep_last": 0},
            "authentication": {"key_file": str(key)} if key else {},
        },
        environ={},
    )

    async def go() -> None:
        journal = Journal(state)
        pipeline = SyncPipeline(
            settings, open_destination(settings.destination), journal, Metrics()
        )
        try:
            await pipeline.evaluate(RUN, name)
            assert await pipeline.drain_once()
            assert name in pipeline.runs[RUN].committed, f"{name} not committed"
        finally:
            await pipeline.close()
            journal.close()

    asyncio.run(go())
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args()
    size = args.size_mib * MIB

    print(f"# {machine_line()}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("\n## Native, 1 MiB blocks")
    print("| digest | CPU-s/GiB, 1 thread | MiB/s wall, 2 threads |")
    print("|---|---:|---:|")
    for name, cpu, mibs in native(min(args.size_mib, 1024)):
        print(f"| {name} | {cpu:.3f} | {mibs:.0f} |")

    root = args.dir / f"ckptd-bench-digest-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        key = root / "manifest.key"
        key.write_text(secrets.token_hex(32) + "\n")
        keys = KeyRing.from_files(key)
        costs: dict[str, list[float]] = {}
        for run in range(args.runs):
            for mode, k in (("CRC-32C only", None), ("CRC-32C + BLAKE3", key)):
                name = f"ck-{run}-{'auth' if k else 'crc'}"
                ckpt = root / "watch" / name
                ckpt.mkdir(parents=True)
                with open(ckpt / "weights.bin", "wb") as fh:
                    for _ in range(args.size_mib):
                        fh.write(os.urandom(MIB))
                (ckpt / "COMPLETE").write_text("")
                up = cpu_per_gib(lambda n=name, k=k: ship(root, n, k) and None, size)
                storage = open_destination(
                    load_settings(
                        overrides={"destination": {"url": f"file://{root / 'store'}"}},
                        environ={},
                    ).destination
                )
                target = root / f"restored-{name}"

                def back(
                    n: str = name, t: Path = target, k: Path | None = k, s: Any = storage
                ) -> None:
                    restore(s, RestoreRequest(RUN, n, t, progress=False, keys=keys if k else None))

                down = cpu_per_gib(back, size)
                costs.setdefault(f"upload|{mode}", []).append(up)
                costs.setdefault(f"restore|{mode}", []).append(down)
                shutil.rmtree(ckpt)
                shutil.rmtree(target)
                shutil.rmtree(root / "store" / RUN / name)
        print(
            f"\n## ckptd, {args.size_mib} MiB checkpoint to file:// on {args.dir}, "
            f"median of {args.runs}"
        )
        print("| path | CRC-32C only, CPU-s/GiB | CRC-32C + BLAKE3, CPU-s/GiB | digest costs |")
        print("|---|---:|---:|---:|")
        for path in ("upload", "restore"):
            crc = statistics.median(costs[f"{path}|CRC-32C only"])
            both = statistics.median(costs[f"{path}|CRC-32C + BLAKE3"])
            print(f"| {path} | {crc:.3f} | {both:.3f} | +{both - crc:.3f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
