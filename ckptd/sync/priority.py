"""The transfer threads' CPU and I/O priority: each thread lowers itself as it starts.

Under ``ckptd run`` a thread inherits the niceness from the main thread already; the
routine pool also goes to SCHED_IDLE with ``cpu_policy = "idle"``, the urgent pool
(``Transfers``: a notice or a flush) never does (``ckptd.runtime.yielding``). A thread
that cannot lower itself says so once per problem, not once per thread.
"""

from __future__ import annotations

from typing import Any

from ckptd.config import Settings
from ckptd.runtime.yielding import idle_this_thread, lower_this_thread, priority_of


class ThreadPriority:
    """The ``thread_setup`` and ``urgent_setup`` of one pipeline's ``Transfers``."""

    def __init__(self, settings: Settings, log: Any) -> None:
        self.settings = settings
        self.log = log
        self._problems: set[str] = set()

    def lower_worker(self) -> None:
        """A thread of the routine pool: down to [resources], and SCHED_IDLE with
        ``cpu_policy = "idle"``."""
        problems = lower_this_thread(priority_of(self.settings.resources))
        if self.settings.resources.cpu_policy == "idle":
            problems += idle_this_thread()
        self._report(problems)

    def lower_urgent_worker(self) -> None:
        """A thread of the urgent pool (``Transfers``): the niceness, never SCHED_IDLE."""
        self._report(lower_this_thread(priority_of(self.settings.resources)))

    def _report(self, problems: list[str]) -> None:
        for problem in problems:
            if problem not in self._problems:
                self._problems.add(problem)
                self.log.warning("priority_not_lowered", problem=problem)
