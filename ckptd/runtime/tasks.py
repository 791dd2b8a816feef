"""The daemon's background tasks, supervised: none ends with an exception nobody handles.

Invariant: every task the daemon starts either runs under ``supervise`` (a failure is
logged as ``task_failed``, counted in ``ckptd_task_failures_total{task}``, and the task
is started again after a backoff) or carries ``retrieve`` as its done-callback (a
one-off task: its failure is logged and counted the same way, and it is never left for
asyncio's "Task exception was never retrieved"). Cancellation is not a failure: it is
how the daemon stops its tasks, and it always propagates.

A bug that makes a task fail at once would otherwise restart it in a tight loop: the
backoff doubles from ``RESTART_FIRST_SECONDS`` to ``RESTART_MAX_SECONDS``, and starts
over once a run of the task lasted ``RESTART_RESET_SECONDS``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ckptd.runtime.metrics import Metrics

RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
RESTART_RESET_SECONDS = 60.0


def note_failure(metrics: Metrics, log: Any, task: str, exc: BaseException) -> None:
    """One failure of ``task``: logged with its traceback, and counted."""
    metrics.task_failures.labels(task=task).inc()
    log.error("task_failed", task=task, error=repr(exc), exc_info=exc)


def doubling(failures: int, first: float, most: float) -> float:
    """A backoff after ``failures`` (>= 1) in a row: ``first``, doubled each time, at
    most ``most`` seconds."""
    return float(min(most, first * 2.0 ** min(failures - 1, 16)))


def restart_delay(failures_in_a_row: int) -> float:
    """Seconds before the next start after ``failures_in_a_row`` (>= 1) quick failures."""
    return doubling(failures_in_a_row, RESTART_FIRST_SECONDS, RESTART_MAX_SECONDS)


async def supervise(
    task: str,
    run: Callable[[], Awaitable[None]],
    *,
    metrics: Metrics,
    log: Any,
    clock: Callable[[], float] | None = None,
) -> None:
    """Run ``run()`` until it returns; each time it raises, note it and start it again
    after the backoff (module doc). Cancelled: it stops, whatever it was doing."""
    now = clock or asyncio.get_running_loop().time
    in_a_row = 0
    while True:
        started = now()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the invariant: logged, counted, restarted
            note_failure(metrics, log, task, exc)
            in_a_row = 1 if now() - started >= RESTART_RESET_SECONDS else in_a_row + 1
            delay = restart_delay(in_a_row)
            log.info("task_restarting", task=task, after_seconds=delay)
            await asyncio.sleep(delay)


def retrieve(task: str, metrics: Metrics, log: Any) -> Callable[[asyncio.Future[Any]], None]:
    """A done-callback for a one-off task: its exception, if any, noted (module doc)."""

    def done(future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            return
        exc = future.exception()  # retrieved: asyncio will not report it again
        if exc is not None:
            note_failure(metrics, log, task, exc)

    return done


def start(coro: Awaitable[Any], task: str, metrics: Metrics, log: Any) -> asyncio.Task[Any]:
    """A one-off task whose failure is noted (``retrieve``)."""
    created = asyncio.ensure_future(coro)
    created.add_done_callback(retrieve(task, metrics, log))
    return created


def start_supervised(
    task: str, run: Callable[[], Awaitable[None]], *, metrics: Metrics, log: Any
) -> asyncio.Task[None]:
    """``supervise(task, run)`` as a task named ``task``."""
    return asyncio.create_task(supervise(task, run, metrics=metrics, log=log), name=task)


async def noted(task: str, done: Awaitable[Any], *, metrics: Metrics, log: Any) -> None:
    """Await ``done``; a failure of it is noted (``note_failure``), never raised: for a
    step that is never worth the daemon (the cadence history's I/O, one step of a stop)."""
    try:
        await done
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the module's invariant
        note_failure(metrics, log, task, exc)
