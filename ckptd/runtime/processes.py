"""What /proc says about another process: its ``stat`` fields, its command line, and
whether it has a handler for a signal.

Invariant: a save signal is only ever sent to a process whose ``SigCgt`` mask has the
signal's bit set (``catches_signal``): for any other process the default action of
SIGUSR1 and most save signals is to terminate, which is what a notice must never do.
Both answers are a snapshot (a process may install its handler a moment later, or exit).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")


def stat_fields(pid: int, *, proc: Path = PROC) -> list[str] | None:
    """The fields of /proc/PID/stat after ``comm``: ``[state, ppid, pgrp, ...]`` (so field
    N of proc(5) is index N - 3); None when ``pid`` is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return stat[stat.rfind(")") + 2 :].split()


def start_ticks(pid: int, *, proc: Path = PROC) -> int | None:
    """``pid``'s start in clock ticks since boot (field 22 of /proc/PID/stat, the same in
    every PID namespace): with the pid it names one process, never a later one given the
    same number. None when it is gone, a zombie or not visible."""
    fields = stat_fields(pid, proc=proc)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def all_stat_fields(*, proc: Path = PROC) -> Iterator[tuple[int, list[str]]]:
    """``(pid, stat_fields(pid))`` of every process alive while /proc is walked."""
    for entry in proc.iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name), proc=proc)
            if fields is not None:  # None: gone since the listing
                yield int(entry.name), fields


def catches_signal(pid: int, signum: int, *, proc: Path = PROC) -> bool:
    """Whether ``pid`` has a handler installed for ``signum`` (``SigCgt`` in
    /proc/PID/status, a hex mask with bit ``signum - 1``); False when it is gone."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def cmdline_of(pid: int, *, proc: Path = PROC) -> str:
    """``pid``'s command line, its arguments joined by spaces ("" when gone or unreadable)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)
