"""Many small requests at once, for stores without a multi-object call (GCS's JSON API,
Azure Blob without Blob Batch): the first error is raised, after every request ended."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


def in_parallel(fn: Callable[[str], None], names: list[str], workers: int = 8) -> None:
    """``fn(name)`` for every name, ``workers`` at a time; the first error is raised."""
    if len(names) <= 1:
        for name in names:
            fn(name)
        return
    with ThreadPoolExecutor(min(workers, len(names)), thread_name_prefix="ckptd-each") as pool:
        for _ in pool.map(fn, names):
            pass
