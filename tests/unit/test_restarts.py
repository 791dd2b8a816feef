"""The restart decision of ``ckptd exec`` (``ckptd.supervision.restarts``), case by case."""

from __future__ import annotations

import signal

from ckptd.supervision.restarts import Attempt, RestartPolicy, cause_of, decide, shell_code

POLICY = RestartPolicy(
    max_restarts=10,
    startup_seconds=60,
    startup_attempts=3,
    same_failure_attempts=5,
    backoff_seconds=1,
    backoff_max_seconds=8,
)
KILLED = -signal.SIGKILL


def crash(code: int = KILLED, seconds: float = 600, progressed: bool = True) -> Attempt:
    return Attempt(code, seconds, progressed)


def test_causes_name_the_exit_code_or_the_signal() -> None:
    assert cause_of(3) == "exit:3"
    assert cause_of(-9) == "signal:SIGKILL"
    assert cause_of(-11) == "signal:SIGSEGV"
    assert shell_code(-9) == 137 and shell_code(0) == 0 and shell_code(7) == 7


def test_a_trainer_that_finishes_is_never_restarted() -> None:
    d = decide([crash(0)], 0, POLICY)
    assert not d.restart and d.reason == "finished"


def test_a_crash_after_progress_restarts_at_once() -> None:
    d = decide([crash()], 0, POLICY)
    assert d.restart and d.delay == 0


def test_max_restarts_is_a_hard_limit_whatever_the_progress() -> None:
    history = [crash() for _ in range(11)]
    assert decide(history[:10], 9, POLICY).restart
    d = decide(history, 10, POLICY)
    assert not d.restart and "10 restart" in d.reason
    assert not decide([crash()], 0, RestartPolicy(max_restarts=0)).restart


def test_crashes_without_progress_back_off_exponentially_up_to_the_cap() -> None:
    # Long-running attempts (not start-up failures), causes varied (not "the same").
    history: list[Attempt] = [crash()]
    delays = []
    for i in range(4):
        history.append(crash(code=10 + i, progressed=False))
        d = decide(history, len(history) - 1, POLICY)
        assert d.restart
        delays.append(d.delay)
    assert delays == [1, 2, 4, 8]
    history.append(crash(code=99, progressed=False))
    assert decide(history, 5, POLICY).delay == 8  # capped


def test_start_up_failures_give_up_after_the_documented_attempts() -> None:
    early = crash(code=1, seconds=2, progressed=False)
    assert decide([early], 0, POLICY).restart
    assert decide([early, early], 1, POLICY).restart
    d = decide([early, early, early], 2, POLICY)
    assert not d.restart and "start-up 3 times" in d.reason


def test_a_slow_failure_is_not_a_start_up_failure() -> None:
    slow = crash(code=1, seconds=61, progressed=False)
    early = crash(code=2, seconds=1, progressed=False)
    assert decide([early, slow, early], 2, POLICY).restart


def test_progress_resets_the_count() -> None:
    early = crash(code=1, seconds=2, progressed=False)
    assert decide([early, early, crash(), early, early], 4, POLICY).restart
    d = decide([early, early, crash(), early, early], 4, POLICY)
    assert d.delay == 2  # two without progress since the last that progressed


def test_the_same_failure_before_any_progress_gives_up() -> None:
    oom = crash(code=KILLED, seconds=3600, progressed=False)
    history = [crash(), oom, oom, oom, oom]
    assert decide(history, 4, POLICY).restart
    d = decide([*history, oom], 5, POLICY)
    assert not d.restart and "5 times in a row with signal:SIGKILL" in d.reason
    # Different causes are not "the same failure".
    mixed = [crash(), oom, crash(code=1, progressed=False), oom, oom, oom]
    assert decide(mixed, 5, POLICY).restart
