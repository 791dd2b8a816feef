"""Sizes and durations as people read them, for the CLI and ``ckptd status`` alike."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable


def human_seconds(s: float) -> str:
    """75 -> '1m15s'; 0 -> '0s'."""
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.0f}s"
    minutes, seconds = divmod(int(s), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
