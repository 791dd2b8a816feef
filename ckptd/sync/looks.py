"""When each checkpoint is looked at: the hints' timers, one look at a time, the retries.

A hint (a file event, a rescan, a part of the pipeline that wants another look) sets a
timer per checkpoint; when it fires the checkpoint is looked at (``Intake.look``: the
completion rule's verdict, and what follows from it). This module decides only when,
and how many at once; what a look finds is the intake's.

A save's file events are a burst (``EVENT_DEBOUNCE_SECONDS`` coalesces it into one look,
``LOOK_SPACING`` keeps looks at a large checkpoint from taking a core); its commit record
(DCP's ``.metadata``, a marker, a tracker, a save report: ``ckptd.sync.watcher``) is one
event, the last, and is looked at with no delay at all (``record_seen``): one look per
save, so nothing to coalesce, and during a notice the push starts that much sooner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from ckptd.layouts.base import Completion
from ckptd.runtime.metrics import Metrics
from ckptd.runtime.tasks import doubling, retrieve
from ckptd.sync.runs import RunState
from ckptd.sync.scanner import list_candidates

# Coalesces the burst of events one save produces into one look at the checkpoint (its
# commit record is looked at with none: ``Looks.record_seen``).
EVENT_DEBOUNCE_SECONDS = 0.2
# ...but a burst that goes on (a save writing GiBs) is looked at at least this often, or
# the files it closed meanwhile would wait for its end to go early.
EVENT_MAX_DELAY_SECONDS = 1.0
# A look lists every file of the checkpoint (0.7 CPU-s for 100,000 files): the next look
# at it waits at least this many times as long as the last one took, so looking at a
# checkpoint being saved costs at most a third of a core, however many files it has
# (and nothing a checkpoint of a few hundred files would notice).
LOOK_SPACING = 2.0
# A look that raised is tried again after this, doubling to the max while it still does.
LOOK_RETRY_SECONDS = 1.0
LOOK_RETRY_MAX_SECONDS = 60.0

Look = Callable[[str, str], Coroutine[Any, Any, Completion | None]]


class Looks:
    """The schedule of looks at checkpoints, for one pipeline.

    Invariants: at most one look at a checkpoint runs at a time (an ask meanwhile gets
    that look's verdict, and one more look follows it); the hints to one checkpoint
    share one timer, which fires within ``EVENT_MAX_DELAY_SECONDS`` of the first but
    never sooner than ``LOOK_SPACING`` times the last look's length after it ended,
    except for a commit record, looked at once (after the look running, if one is); a
    look that raised is asked for again after a doubling backoff; and ``busy()`` holds
    from a hint until its verdict is queued, with no gap between timer and look.
    """

    def __init__(
        self, runs: Mapping[str, RunState], look: Look, *, tier_metrics: Metrics, log: Any
    ) -> None:
        self.runs = runs
        self._look = look  # ``Intake.look``
        self.tier_metrics = tier_metrics
        self.log = log
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        # When the pending look at a checkpoint was first asked for (loop time).
        self._first_hint: dict[tuple[str, str], float] = {}
        # When the last look at a checkpoint ended, and how long it took (loop time); the
        # look running now, and whether another was asked for meanwhile.
        self._last_look: dict[tuple[str, str], tuple[float, float]] = {}
        self._looking: dict[tuple[str, str], asyncio.Task[Completion | None]] = {}
        self._look_after: set[tuple[str, str]] = set()
        # ...of which a commit record was seen meanwhile: the next look follows at once.
        self._record_after: set[tuple[str, str]] = set()
        # Looks that raised in a row, per checkpoint (``_look_failed``'s backoff).
        self._look_failures: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._evaluating = 0

    def hint(self, run_id: str, name: str | None, delay: float = EVENT_DEBOUNCE_SECONDS) -> None:
        """Something under ``run_id``'s dir changed (``name`` None: look at all of it).
        Must be called on the event loop thread."""
        state = self.runs.get(run_id)
        if state is None:
            return
        if name is None:
            for candidate in state.seen - state.committed:
                self.hint(run_id, candidate, delay)
            self._spawn(self.rescan(run_id))
            return
        key = (run_id, name)
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        now = loop.time()
        if old is None:
            self._first_hint[key] = now
        else:  # a burst: no later than EVENT_MAX_DELAY_SECONDS after its first hint
            first = self._first_hint.setdefault(key, now)
            delay = min(delay, max(0.0, first + EVENT_MAX_DELAY_SECONDS - now))
        ended, took = self._last_look.get(key, (0.0, 0.0))
        delay = max(delay, ended + LOOK_SPACING * took - now)

        def fire() -> None:
            self._first_hint.pop(key, None)
            self._spawn(self.evaluate(run_id, name))

        self._timers[key] = loop.call_later(delay, fire)

    def record_seen(self, run_id: str, name: str | None) -> None:
        """A commit record appeared for ``name`` (None: a tracker or a save report, which
        may complete any checkpoint of the run): look at it now, unspaced and with no
        debounce; if a look at it runs, the next one follows that at once. Must be
        called on the event loop thread."""
        state = self.runs.get(run_id)
        if state is None:
            return
        if name is None:
            for candidate in state.seen - state.committed:
                self.record_seen(run_id, candidate)
            self._spawn(self.rescan(run_id))
            return
        key = (run_id, name)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._first_hint.pop(key, None)
        if key in self._looking:
            self._look_after.add(key)
            self._record_after.add(key)
            return
        # A timer of no delay rather than a task at once: busy() holds from here on.
        self._timers[key] = asyncio.get_running_loop().call_later(
            0.0, lambda: self._spawn(self.evaluate(run_id, name))
        )

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """A look or a rescan beside the caller; a failure of it is logged and counted
        (``ckptd.runtime.tasks.retrieve``), never left unretrieved."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(retrieve("look", self.tier_metrics, self.log))

    async def rescan(self, run_id: str, *, committed: bool = False) -> None:
        """``SyncPipeline.rescan``: look at every checkpoint of a run."""
        state = self.runs[run_id]
        if not state.dir.is_dir():
            return
        names = await asyncio.to_thread(list_candidates, state.dir)
        for name in names:
            if committed or name not in state.committed:
                await self.evaluate(run_id, name)

    async def evaluate(self, run_id: str, name: str) -> Completion | None:
        """``SyncPipeline.evaluate``: look at one checkpoint now, one look at a time."""
        key = (run_id, name)
        running = self._looking.get(key)
        if running is not None:
            self._look_after.add(key)
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - said and retried by the look's own evaluate
                return None
        # Counted from before the timer is dropped to after a verdict is queued, so idle()
        # never sees the gap between "timer fired" and "checkpoint pending".
        self._evaluating += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        look = self._looking[key] = loop.create_task(self._look(run_id, name))
        self._tasks.add(look)  # cancelled by close() like the rest
        look.add_done_callback(self._tasks.discard)
        try:
            self._timers.pop(key, None)
            verdict = await asyncio.shield(look)
            self._look_failures.pop(key, None)
            return verdict
        except asyncio.CancelledError:
            if not look.done():  # cancelled while it runs: its outcome is still noted
                look.add_done_callback(retrieve("look", self.tier_metrics, self.log))
            raise
        except Exception as exc:  # noqa: BLE001 - one look never stops the others
            self._look_failed(run_id, name, exc)
            return None
        finally:
            if look.done():
                self._looking.pop(key, None)
            else:  # cancelled while it runs: the look finishes on its own
                look.add_done_callback(lambda _: self._looking.pop(key, None))
            self._evaluating -= 1
            ended = loop.time()
            self._last_look[key] = (ended, ended - started)
            if len(self._last_look) > 4096:  # a long run's old names: nothing to space
                self._last_look = {k: v for k, v in self._last_look.items() if v[0] > ended - 600}
            if key in self._record_after:
                self._record_after.discard(key)
                self._look_after.discard(key)
                self.record_seen(run_id, name)
            elif key in self._look_after:
                self._look_after.discard(key)
                self.hint(run_id, name)  # spaced by LOOK_SPACING

    def _look_failed(self, run_id: str, name: str, exc: Exception) -> None:
        """A look that raised (the journal's disk full, a bug): logged, counted, and the
        checkpoint looked at again after a backoff that doubles up to
        ``LOOK_RETRY_MAX_SECONDS``, so a failure that lasts costs little and one that
        passes delays it by seconds."""
        key = (run_id, name)
        failures = self._look_failures[key] = self._look_failures.get(key, 0) + 1
        delay = doubling(failures, LOOK_RETRY_SECONDS, LOOK_RETRY_MAX_SECONDS)
        self.tier_metrics.task_failures.labels(task="look").inc()
        self.log.error(
            "checkpoint_look_failed",
            run=run_id,
            checkpoint=name,
            error=repr(exc),
            retry_in_seconds=delay,
            exc_info=exc if failures == 1 else None,
        )
        self.hint(run_id, name, delay)

    def busy(self) -> bool:
        """A look is waited for (a timer set) or running."""
        busy_timers = [k for k, t in self._timers.items() if not t.cancelled()]
        return bool(busy_timers) or bool(self._evaluating)

    def pending(self, run_id: str) -> set[str]:
        """The checkpoints of ``run_id`` a look is waited for (a timer set) or running."""
        timers = {n for (r, n), t in self._timers.items() if r == run_id and not t.cancelled()}
        return timers | {n for (r, n) in self._looking if r == run_id}

    def close(self) -> None:
        """Every timer and every look or rescan in flight cancelled."""
        for timer in self._timers.values():
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()
