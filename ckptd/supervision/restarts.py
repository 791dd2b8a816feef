"""When a supervised trainer ends, whether to start it again, and after how long (pure).

Words, as docs/exec.md ("Restart policy") defines them:

- an *attempt* is one run of ``CMD``, from its start to its end;
- it *failed* when it exited non-zero or died by a signal (exit 0 is the trainer
  finishing: never restarted);
- it *progressed* when, at its end, the newest complete local checkpoint is newer than the
  one it was started from (a higher step; any checkpoint at all when it started from none);
- it is a *start-up failure* when it failed without progress within
  ``startup_seconds`` of its start.

The decision after a failed attempt, in order:

1. ``max_restarts`` restarts were made already: give up;
2. the last ``startup_attempts`` attempts were all start-up failures: give up (the
   trainer cannot start: a bad flag, a missing file, an import error);
3. the last ``same_failure_attempts`` attempts all failed without progress and with the
   same cause (the same exit code, or the same signal): give up (it fails the same way
   before it saves anything, however long it runs);
4. otherwise restart, at once when the attempt progressed (a crash after useful work:
   every second lost is lost training), else after ``backoff_seconds`` doubled per
   attempt without progress before it, capped at ``backoff_max_seconds``.

Progress resets the counts of rules 2 to 4. The clock is an argument; nothing here reads it.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_RESTARTS = 10


@dataclass(frozen=True)
class RestartPolicy:
    """The knobs of the decision (module doc)."""

    max_restarts: int = DEFAULT_MAX_RESTARTS
    startup_seconds: float = 60.0
    startup_attempts: int = 3
    same_failure_attempts: int = 5
    backoff_seconds: float = 1.0
    backoff_max_seconds: float = 60.0


@dataclass(frozen=True)
class Attempt:
    """One finished run of the trainer."""

    returncode: int  # asyncio's: negative for death by a signal
    seconds: float  # from its start to its end
    progressed: bool

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    @property
    def cause(self) -> str:
        """``exit:<code>`` or ``signal:<NAME>`` (a metric label and a log field)."""
        return cause_of(self.returncode)


@dataclass(frozen=True)
class Decision:
    """What to do after an attempt: restart after ``delay`` seconds, or stop."""

    restart: bool
    delay: float
    reason: str


def cause_of(returncode: int) -> str:
    """``exit:3``, or ``signal:SIGKILL`` for asyncio's negative return codes."""
    if returncode >= 0:
        return f"exit:{returncode}"
    try:
        return f"signal:{signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal:{-returncode}"


def shell_code(returncode: int) -> int:
    """The code a shell reports for ``returncode``: 128 + N for death by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def is_startup_failure(attempt: Attempt, policy: RestartPolicy) -> bool:
    return attempt.failed and not attempt.progressed and attempt.seconds < policy.startup_seconds


def _trailing_without_progress(history: Sequence[Attempt]) -> list[Attempt]:
    """The failed attempts since the last one that progressed (or finished), oldest first."""
    tail: list[Attempt] = []
    for attempt in reversed(history):
        if attempt.progressed or not attempt.failed:
            break
        tail.append(attempt)
    tail.reverse()
    return tail


def decide(history: Sequence[Attempt], restarts: int, policy: RestartPolicy) -> Decision:
    """After the last attempt of ``history`` (oldest first; ``restarts`` made so far)."""
    last = history[-1]
    if not last.failed:
        return Decision(False, 0.0, "finished")
    if restarts >= policy.max_restarts:
        return Decision(False, 0.0, f"gave up after {restarts} restart(s) (--max-restarts)")
    if last.progressed:
        return Decision(True, 0.0, f"{last.cause} after progress")
    stuck = _trailing_without_progress(history)
    startup = stuck[-policy.startup_attempts :]
    if len(startup) >= policy.startup_attempts and all(
        is_startup_failure(a, policy) for a in startup
    ):
        return Decision(
            False,
            0.0,
            f"failed at start-up {len(startup)} times in a row "
            f"(within {policy.startup_seconds:g} s, no checkpoint)",
        )
    same = stuck[-policy.same_failure_attempts :]
    if len(same) >= policy.same_failure_attempts and len({a.cause for a in same}) == 1:
        return Decision(
            False,
            0.0,
            f"failed {len(same)} times in a row with {last.cause} and no new checkpoint",
        )
    delay = min(policy.backoff_seconds * 2 ** (len(stuck) - 1), policy.backoff_max_seconds)
    return Decision(True, delay, f"{last.cause} without progress")
