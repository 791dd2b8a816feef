"""Deadline planning for an emergency flush. Pure: bytes, rates and times in, a plan out.

Given what is left to send and the upload rate measured so far, say when the flush will
finish, whether that is before the deadline, and whether an older upload in flight can
finish first without putting the emergency checkpoint at risk.
"""

from __future__ import annotations

from dataclasses import dataclass

# Plan against a fraction of the time left: rates fluctuate, and the manifest, LATEST
# and the cloud's own shutdown all need a moment after the last byte.
SAFETY = 0.8


@dataclass(frozen=True)
class FlushPlan:
    eta_seconds: float | None  # None when no rate has been measured yet
    seconds_left: float | None  # None when the notice has no deadline
    will_make_it: bool | None  # None when either is unknown

    @property
    def margin_seconds(self) -> float | None:
        if self.eta_seconds is None or self.seconds_left is None:
            return None
        return self.seconds_left - self.eta_seconds


def plan_flush(
    bytes_left: int, rate_bytes_per_s: float | None, seconds_left: float | None
) -> FlushPlan:
    """When ``bytes_left`` will be sent at ``rate``, against ``seconds_left``."""
    eta = None if not rate_bytes_per_s else bytes_left / rate_bytes_per_s
    verdict = None if eta is None or seconds_left is None else eta <= seconds_left * SAFETY
    return FlushPlan(eta, seconds_left, verdict)


def may_finish_first(
    current_bytes_left: int,
    emergency_bytes: int,
    rate_bytes_per_s: float | None,
    seconds_left: float | None,
) -> bool:
    """Whether the upload in flight may finish before the emergency checkpoint starts.
    Unknown rate or deadline: no (the emergency checkpoint is the one that matters)."""
    if not rate_bytes_per_s or seconds_left is None:
        return False
    both = (current_bytes_left + emergency_bytes) / rate_bytes_per_s
    return both <= seconds_left * SAFETY
