"""The training's own health: the loss-spike rule over the losses the trainer reports
(``ckptd.trainer.report_step(step, loss=...)``), docs/health.md "The training's own health".

The rule, report by report:

- a loss that is not finite (NaN, ±inf) is a ``non-finite`` event;
- once ``min_reports`` finite losses are in the trailing window (the last ``window`` ones
  judged normal), a loss whose z-score against the window,
  ``(loss - mean) / max(std, REL_FLOOR * |mean|)``, is above ``z`` is a ``spike``. Only
  upward: a loss that falls is no fault. The floor keeps a nearly flat loss (std near 0)
  from turning a wiggle of a thousandth into a spike;
- the first spike or non-finite loss opens an *episode* (one event, however many bad
  reports of its kind follow; a first non-finite loss in a spike's episode is one more
  event: the training got worse); reports judged bad stay out of the window, so the
  baseline is the loss from before the spike;
- the episode ends ``stable`` after ``window`` reports in a row judged normal against
  that baseline (the loss came back); or, when the loss settles at a new level (the
  episode's last ``window`` reports all finite and bad), the window starts again from
  them without a ``stable`` (the loss did not come back: what protects the rollback
  target runs out by time, not by this).

Invariant: pure: a function of the reports given, in their order (no I/O, no clock); a
report's step is the trainer's, never compared with the time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

__all__ = ["REL_FLOOR", "LossEvent", "LossRule", "LossTracker"]

# The smallest standard deviation a window is judged with, relative to its mean.
REL_FLOOR = 1e-3
# ... and in absolute terms, for a loss near 0.
ABS_FLOOR = 1e-12

EventKind = Literal["spike", "non-finite", "stable"]


@dataclass(frozen=True)
class LossRule:
    """The rule's settings (``[health] loss_window``, ``loss_z``, ``loss_min_reports``)."""

    window: int = 50
    z: float = 6.0
    min_reports: int = 20

    def __post_init__(self) -> None:
        if self.window < 2 or not 2 <= self.min_reports <= self.window or not self.z > 0:
            raise ValueError("need window >= min_reports >= 2 and z > 0")


@dataclass(frozen=True)
class LossEvent:
    """What a report did: opened an episode (``spike``, ``non-finite``) at ``step``, or
    closed one (``stable``). ``mean`` and ``std`` are the baseline it was judged
    against (0 where there was none yet), ``z`` the spike's z-score (None otherwise)."""

    kind: EventKind
    step: int
    loss: float
    mean: float = 0.0
    std: float = 0.0
    z: float | None = None


class LossTracker:
    """One run's losses, judged one report at a time (module doc)."""

    def __init__(self, rule: LossRule) -> None:
        self.rule = rule
        self.window: deque[float] = deque(maxlen=rule.window)
        self.episode: LossEvent | None = None  # the event that opened the current one
        self.kinds: set[str] = set()  # the kinds of event it made
        self.calm = 0  # reports in a row judged normal during an episode
        self.bad: deque[float] = deque(maxlen=rule.window)  # the episode's finite bad ones
        self.reports = 0

    @property
    def volatile(self) -> bool:
        """An episode is open: the loss spiked (or was not finite) and did not come back."""
        return self.episode is not None

    def baseline(self) -> tuple[float, float] | None:
        """The window's mean and floored standard deviation; None with too few reports."""
        n = len(self.window)
        if n < self.rule.min_reports:
            return None
        mean = math.fsum(self.window) / n
        var = math.fsum((x - mean) ** 2 for x in self.window) / (n - 1)
        return mean, max(math.sqrt(var), REL_FLOOR * abs(mean), ABS_FLOOR)

    def observe(self, step: int, loss: float) -> LossEvent | None:
        """Judge one report; the event it makes, if any."""
        self.reports += 1
        if not math.isfinite(loss):
            self.calm = 0
            return self._open(LossEvent("non-finite", step, loss, *self._stats()))
        base = self.baseline()
        if base is not None:
            mean, std = base
            z = (loss - mean) / std
            if z > self.rule.z:
                self.calm = 0
                self.bad.append(loss)
                if len(self.bad) == self.rule.window:  # settled at a new level
                    self.window.clear()
                    self.window.extend(self.bad)
                    self.bad.clear()
                    self.episode = None
                    return None
                return self._open(LossEvent("spike", step, loss, mean, std, z))
        self.window.append(loss)
        if self.episode is None:
            return None
        self.calm += 1
        if self.calm < self.rule.window:
            return None
        self.episode, self.calm = None, 0
        self.bad.clear()
        return LossEvent("stable", step, loss, *self._stats())

    def _stats(self) -> tuple[float, float]:
        base = self.baseline()
        return base if base is not None else (0.0, 0.0)

    def _open(self, event: LossEvent) -> LossEvent | None:
        if self.episode is None:
            self.episode, self.kinds = event, {event.kind}
            return event
        if event.kind in self.kinds:
            return None
        self.kinds.add(event.kind)
        return event
