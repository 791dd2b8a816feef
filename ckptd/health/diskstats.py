"""A block device's I/O latency from ``/proc/diskstats``: the checkpoint filesystem's
disk slowing down (a failing NVMe, a throttled cloud volume) shows here first.

Shape (Documentation/admin-guide/iostats.rst): one line per device, ``major minor name``
then reads completed, reads merged, sectors read, milliseconds spent reading, writes
completed, writes merged, sectors written, milliseconds spent writing, and more. The
latency over a poll is the milliseconds spent reading and writing that grew, over the
reads and writes completed that grew.

Invariant: pure. The file's text and the device's numbers are arguments; a device not
listed (tmpfs, NFS: major 0) has no reading, never an error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IoCounts:
    """One device's completed I/Os and the milliseconds they took."""

    name: str
    ios: int
    ms: int


def device_counts(text: str, major: int, minor: int) -> IoCounts | None:
    """The counts of device ``major:minor`` in ``/proc/diskstats``' text, or None."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 11 or not (fields[0].isdigit() and fields[1].isdigit()):
            continue
        if (int(fields[0]), int(fields[1])) != (major, minor):
            continue
        try:
            reads, read_ms, writes, write_ms = (int(fields[i]) for i in (3, 6, 7, 10))
        except ValueError:
            return None
        return IoCounts(fields[2], reads + writes, read_ms + write_ms)
    return None


def latency_seconds(before: IoCounts | None, now: IoCounts | None) -> float | None:
    """Mean seconds per I/O completed between two readings; None without I/O or readings."""
    if before is None or now is None or now.name != before.name:
        return None
    ios = now.ios - before.ios
    if ios <= 0:
        return None
    return max(0, now.ms - before.ms) / ios / 1000.0
