"""Memory pressure read as health events: PSI and the trainer's cgroup.

Shapes (Documentation/accounting/psi.rst, Documentation/admin-guide/cgroup-v2.rst):

- ``/proc/pressure/memory`` and a cgroup's ``memory.pressure``::

      some avg10=0.00 avg60=0.00 avg300=0.00 total=0
      full avg10=0.00 avg60=0.00 avg300=0.00 total=0

- a cgroup's ``memory.events``: ``low N``, ``high N``, ``max N``, ``oom N``,
  ``oom_kill N``, ``oom_group_kill N``, one per line, counts since the cgroup began;
- ``memory.current``: bytes in use; ``memory.max``: the limit in bytes, or ``max``.

Invariant: pure. The texts read, the previous ``memory.events`` counts and the
thresholds are arguments; a text that does not parse is no event.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckptd.health.model import HealthEvent

SOURCE = "memory"


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """``{"some": {"avg10": ..., ...}, "full": {...}}``; lines that do not parse are left out."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        values: dict[str, float] = {}
        for item in rest.split():
            key, sep, value = item.partition("=")
            try:
                if sep:
                    values[key] = float(value)
            except ValueError:
                continue
        if kind in ("some", "full") and values:
            out[kind] = values
    return out


def parse_counts(text: str) -> dict[str, int]:
    """A flat-keyed file such as ``memory.events``: ``{"oom_kill": 2, ...}``."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def parse_limit(text: str) -> int | None:
    """``memory.max``: bytes, or None for ``max`` (no limit) or what does not parse."""
    value = text.strip()
    return int(value) if value.isdigit() else None


def pressure_event(
    where: str, psi_text: str, full_avg10_percent: float, at: float
) -> HealthEvent | None:
    """A degrading event when ``full avg10`` (every task stalled on memory, the last
    10 s) is above the threshold."""
    full = parse_psi(psi_text).get("full", {}).get("avg10")
    if full is None or full <= full_avg10_percent:
        return None
    return HealthEvent(
        SOURCE,
        "memory-pressure",
        "degrading",
        f"{where}: memory full avg10={full:.2f}% > {full_avg10_percent:g}%",
        at,
        {"where": where, "full_avg10": full},
    )


def oom_kill_events(
    previous: Mapping[str, int] | None, events_text: str, at: float
) -> tuple[dict[str, int], HealthEvent | None]:
    """The counts now, and a degrading event when ``oom_kill`` grew since ``previous``
    (None: the first reading, which only sets the baseline)."""
    now = parse_counts(events_text)
    if previous is None or "oom_kill" not in now:
        return now, None
    grew = now["oom_kill"] - previous.get("oom_kill", 0)
    if grew <= 0:
        return now, None
    return now, HealthEvent(
        SOURCE,
        "oom-kill",
        "degrading",
        f"the trainer's cgroup had {grew} OOM kill(s) (memory.events oom_kill {now['oom_kill']})",
        at,
        {"oom_kill": now["oom_kill"], "new": grew},
    )


def limit_event(current_text: str, max_text: str, ratio: float, at: float) -> HealthEvent | None:
    """A degrading event when the cgroup uses more than ``ratio`` of its limit."""
    limit = parse_limit(max_text)
    used = parse_limit(current_text)
    if limit is None or used is None or limit == 0 or used <= ratio * limit:
        return None
    return HealthEvent(
        SOURCE,
        "memory-limit",
        "degrading",
        f"the trainer's cgroup uses {used} of its {limit} bytes ({used / limit:.1%} > {ratio:.0%})",
        at,
        {"current": used, "max": limit},
    )
