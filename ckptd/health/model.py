"""The one event type every health source produces.

As a notice source yields ``Notice`` (``ckptd.notices.model``), a health source yields
``HealthEvent``: which source heard it, what kind of fault (``xid-79``, ``oom-kill``,
``io-error``, ``memory-pressure``, ``memory-limit``, ``disk-space``,
``store-unreachable``), and how bad. Invariant: the severity is the source's reading of
the fault, never what to do about it; that is ``ckptd.health.decide``'s, from the
configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

#: degrading: the node still trains but is failing (save now); fatal: too late (the GPU
#: or the trainer is gone: record it); warning: worth saying (a disk too full for the
#: next save); ignore: heard and let be (an application's own fault).
Severity = Literal["degrading", "fatal", "warning", "ignore"]
SEVERITIES: tuple[Severity, ...] = ("degrading", "fatal", "warning", "ignore")


@dataclass(frozen=True)
class HealthEvent:
    """One fault heard by one source; ``at`` is Unix time, ``message`` the line itself
    (or the reading) as the source saw it."""

    source: str
    kind: str
    severity: Severity
    message: str
    at: float
    detail: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "severity": self.severity,
            "message": self.message,
            "at": self.at,
            "detail": dict(self.detail),
        }
