"""What one health event makes the daemon do, from the configuration and the daemon's
state: save, save-and-stop, report, or nothing.

Invariant: pure; the time and whether a save is in progress are arguments. A ``save``
is never started during a save: it is deferred (``defer``) and decided again once that
save is over; and at most one is started per event kind per ``save_interval`` (a flood
of one event gives one save), the rest reported. A ``save-and-stop`` is a notice: it
waits for no save, and only the rate limit holds it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ckptd.health.model import HealthEvent, Severity

Action = Literal["save", "save-and-stop", "report"]
Outcome = Literal["save", "save-and-stop", "report", "ignore", "defer"]


@dataclass(frozen=True)
class Policy:
    """The configured action per severity, and the rate limit of saves."""

    actions: Mapping[Severity, Action]
    save_interval: float


@dataclass(frozen=True)
class Decision:
    """What to do, and why (for the log line)."""

    outcome: Outcome
    why: str


@dataclass
class SaveLimit:
    """When each event kind last caused a save (Unix time)."""

    last: dict[str, float] = field(default_factory=dict)

    def decide(self, event: HealthEvent, policy: Policy, *, now: float, saving: bool) -> Decision:
        """The decision for ``event``; a save or stop decided is recorded for its kind."""
        if event.severity == "ignore":
            return Decision("ignore", "the table says to let it be")
        action = policy.actions.get(event.severity, "report")
        if action == "report":
            return Decision("report", f"on_{event.severity} = report")
        last = self.last.get(event.kind)
        if last is not None and now - last < policy.save_interval:
            return Decision(
                "report",
                f"one save per {event.kind} per {policy.save_interval:g} s: the last was "
                f"{now - last:.0f} s ago",
            )
        if action == "save" and saving:
            return Decision("defer", "a save is in progress: this one starts after it")
        self.last[event.kind] = now
        return Decision(action, f"on_{event.severity} = {action}")
