"""Staying out of the trainer's way: lower CPU and I/O priority, and a bounded page cache.

Invariant: the daemon never raises its own priority and never fails because it could
not lower it. ``lower_this_thread`` only moves the calling thread *down* (a higher nice
value, a lower I/O class or level); where the kernel or a seccomp filter refuses (the
systemd unit already sets ``Nice=``/``IOSchedulingClass=``, and its system-call filter
forbids ``setpriority``/``ioprio_set``), it reports why and the daemon carries on.

``idle_this_thread`` goes further for the transfer threads (``[resources] cpu_policy``):
``SCHED_IDLE``, under which a thread runs only when its CPU has nothing else to run and
gives way at once when anything else wakes. Nice 19 does not do that for a daemon: each
of its threads is weighed on its own (1.4 % of a contended CPU each), so eight transfer
threads took 5.5 % of the trainer's core in ``bench_interference.py``. An unprivileged
thread cannot leave ``SCHED_IDLE``, so work that must not wait (an emergency checkpoint)
runs on threads that never entered it (``ckptd.sync.transfer``'s urgent pool).

Linux keeps these values per thread, and a new thread inherits its creator's: called
first thing in ``ckptd run``, before any thread exists, it covers the whole daemon;
``ckptd exec`` must not hand its lowered priority to the trainer it starts, so there
only the transfer workers lower themselves (the pool's initializer).

``drop_cached`` is ``posix_fadvise(POSIX_FADV_DONTNEED)`` over a range just read or
written: clean pages of checkpoint data leave the page cache at once, so shipping a
checkpoint larger than memory does not evict the trainer's dataset.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import psutil

from ckptd.config import ResourcesConfig

# psutil's names for the I/O classes ckptd may move down to.
_IO_CLASSES = {"best-effort": psutil.IOPRIO_CLASS_BE, "idle": psutil.IOPRIO_CLASS_IDLE}
# Lower rank = more urgent; "none" (never set) behaves as best-effort.
_IO_RANK: dict[int, int] = {
    int(psutil.IOPRIO_CLASS_RT): 0,
    int(psutil.IOPRIO_CLASS_NONE): 1,
    int(psutil.IOPRIO_CLASS_BE): 1,
    int(psutil.IOPRIO_CLASS_IDLE): 2,
}
# The level a thread without an I/O class is taken to have (the kernel derives it from
# the niceness; 4 is its value at nice 0).
_UNSET_LEVEL = 4


@dataclass(frozen=True)
class Priority:
    """What ``[resources]`` asks for; ``io_class = "none"`` leaves I/O priority alone."""

    nice: int = 19
    io_class: str = "best-effort"
    io_level: int = 7


def priority_of(resources: ResourcesConfig) -> Priority:
    return Priority(resources.nice, resources.io_class, resources.io_priority)


def _io_is_at_or_below(current: tuple[int, int], cls: int, level: int) -> bool:
    """Whether I/O priority ``current`` (class, level) is already no higher than
    ``cls``/``level``."""
    cur_cls, cur_level = current
    if cur_cls == psutil.IOPRIO_CLASS_NONE:
        cur_level = _UNSET_LEVEL
    if _IO_RANK[cur_cls] != _IO_RANK[cls]:
        return _IO_RANK[cur_cls] > _IO_RANK[cls]
    return cls == psutil.IOPRIO_CLASS_IDLE or cur_level >= level


def lower_this_thread(priority: Priority) -> list[str]:
    """Move the calling thread down to ``priority``; returns one line per refusal."""
    problems: list[str] = []
    thread = psutil.Process(threading.get_native_id())
    try:
        if priority.nice and thread.nice() < priority.nice:
            thread.nice(priority.nice)
    except (OSError, psutil.Error) as exc:
        problems.append(f"resources.nice: could not set nice {priority.nice}: {exc}")
    if priority.io_class != "none":
        cls = _IO_CLASSES[priority.io_class]
        level = priority.io_level if cls == psutil.IOPRIO_CLASS_BE else 0
        try:
            current_cls, current_level = thread.ionice()
            if not _io_is_at_or_below((int(current_cls), int(current_level)), int(cls), level):
                thread.ionice(cls, level if cls == psutil.IOPRIO_CLASS_BE else None)
        except (OSError, psutil.Error) as exc:
            problems.append(
                f"resources.io_class: could not set I/O class {priority.io_class}: {exc}"
            )
    return problems


def idle_this_thread() -> list[str]:
    """Move the calling thread to ``SCHED_IDLE`` (module doc); one line if refused."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_IDLE:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        return [f"resources.cpu_policy: could not set SCHED_IDLE: {exc}"]
    return []


def drop_cached(fd: int, offset: int, length: int) -> None:
    """Tell the kernel these pages of ``fd`` will not be needed again (clean ones go)."""
    if length > 0:
        # Advice only: a filesystem that does not take it costs nothing.
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
