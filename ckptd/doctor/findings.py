"""What ``ckptd doctor`` found, and the decisions behind each verdict: pure (data in,
verdicts out; no I/O, no clock).

A ``Finding`` is one line: a check's name, its status, what was found and, unless it is
ok, the fix. ``ok`` and ``warn`` leave the exit code 0, any ``fail`` makes it 1; ``skip``
is a check that could not run because one it needs failed (that one says why), or that
does not apply here. The bounds a verdict uses are stated here, once, and documented in
docs/operations.md ("Preflight").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "skip"]

#: The store's clock may be this far from this node's before ``clock`` warns. Clocks
#: across nodes order what ckptd compares: a cluster NOTICE older than a daemon's start is
#: ignored, retention's ``keep_within`` and the goodput ledger read commit times, and S3
#: refuses a request signed more than 15 minutes off (RequestTimeTooSkewed).
CLOCK_SKEW_WARN_SECONDS = 5.0
#: The resolution of the times stores report (S3 and Azure: whole seconds).
STORE_TIME_RESOLUTION_SECONDS = 1.0
#: Free space under which ``disk`` warns: the state dir holds the journal (small, but a
#: full disk stops it recording finished parts); a watch dir needs room for the next
#: checkpoint before the daemon can ship and local retention delete the one before.
STATE_MIN_FREE_BYTES = 1 << 30
WATCH_MIN_FREE_BYTES = 10 << 30


@dataclass(frozen=True)
class Finding:
    """One check's verdict."""

    check: str  # "config", "credentials", "destination", "create-only", ...
    status: Status
    message: str  # what was found
    fix: str = ""  # what to do about it ("" when there is nothing to do)
    where: str = ""  # the tier or directory it concerns, when there are several

    def line(self) -> str:
        """The one line ``ckptd doctor`` prints."""
        where = f"[{self.where}] " if self.where else ""
        fix = f"; fix: {self.fix}" if self.fix and self.status != "ok" else ""
        return f"{self.status:<5} {self.check:<12} {where}{self.message}{fix}"

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "status": self.status,
            "message": self.message,
            "fix": self.fix,
            "where": self.where,
        }


def exit_code(findings: Iterable[Finding]) -> int:
    """0 when nothing failed, else 1."""
    return 1 if any(f.status == "fail" for f in findings) else 0


def document(findings: Sequence[Finding]) -> dict[str, Any]:
    """``--json``'s one document."""
    return {"ok": exit_code(findings) == 0, "findings": [f.to_json() for f in findings]}


def clock_skew(store_time: float, sent: float, answered: float) -> float:
    """How far the store's clock is ahead (+) or behind (-) this node's, from the time
    the store gave an object written between ``sent`` and ``answered`` (this node's
    clock), to within ``STORE_TIME_RESOLUTION_SECONDS``: 0 when it falls in that window."""
    if store_time < sent - STORE_TIME_RESOLUTION_SECONDS:
        return store_time - (sent - STORE_TIME_RESOLUTION_SECONDS)
    if store_time > answered:
        return store_time - answered
    return 0.0


def clock_finding(skew: float, url: str, where: str = "") -> Finding:
    """``clock``'s verdict on a measured ``skew``."""
    if abs(skew) <= CLOCK_SKEW_WARN_SECONDS:
        return Finding(
            "clock",
            "ok",
            f"{url}: the store's clock is within {CLOCK_SKEW_WARN_SECONDS:g} s of this node's",
            where=where,
        )
    side = "ahead of" if skew > 0 else "behind"
    return Finding(
        "clock",
        "warn",
        f"{url}: the store's clock is {abs(skew):.0f} s {side} this node's (more than "
        f"{CLOCK_SKEW_WARN_SECONDS:g} s)",
        "synchronise this node's clock (chrony or systemd-timesyncd against the cloud's "
        "time service); S3 refuses requests signed more than 15 minutes off",
        where,
    )


def free_space_finding(what: str, path: str, free: int, minimum: int) -> Finding:
    """``disk``'s verdict on ``free`` bytes under ``path`` (``what``: "state dir", ...)."""
    gib = free / (1 << 30)
    if free >= minimum:
        return Finding("disk", "ok", f"{what} {path}: {gib:.1f} GiB free")
    return Finding(
        "disk",
        "warn",
        f"{what} {path}: {gib:.2f} GiB free, under {minimum / (1 << 30):g} GiB",
        "free space on that filesystem (older checkpoints: [retention] local_keep_last), "
        "or move the directory to a larger one",
    )


__all__ = [
    "CLOCK_SKEW_WARN_SECONDS",
    "STATE_MIN_FREE_BYTES",
    "STORE_TIME_RESOLUTION_SECONDS",
    "WATCH_MIN_FREE_BYTES",
    "Finding",
    "Status",
    "clock_finding",
    "clock_skew",
    "document",
    "exit_code",
    "free_space_finding",
]
