"""The checkpoint filesystem's free space, read as a health event.

Invariant: pure. The free bytes (``statvfs``'s ``f_bavail * f_frsize``, read at the edge)
and the run's last save size are arguments. A save needs about as much room as the one
before it; with less, the next save fails half-written, so this warns before it.
"""

from __future__ import annotations

from ckptd.health.model import HealthEvent

SOURCE = "disk"


def space_event(
    run: str, path: str, free_bytes: int, last_save_bytes: int | None, factor: float, at: float
) -> HealthEvent | None:
    """A warning when ``free_bytes`` is under ``factor`` times the last save; None when
    there is room, or no save to measure by yet."""
    if not last_save_bytes:
        return None
    needed = int(factor * last_save_bytes)
    if free_bytes >= needed:
        return None
    return HealthEvent(
        SOURCE,
        "disk-space",
        "warning",
        f"{path}: {free_bytes} bytes free, the next save of {run} needs about {needed} "
        f"(its last was {last_save_bytes})",
        at,
        {"run": run, "path": path, "free_bytes": free_bytes, "last_save_bytes": last_save_bytes},
    )
