"""``ckptd exec`` after a notice: the waits between the trainer's signal and exec's exit.

    1. ``await_emergency``: until the emergency checkpoint is committed, or it is clear
       that none is coming (the trainer is gone and nothing is left to ship, quiet for
       ``DRAIN_QUIET_SECONDS``), or the store refuses this node, or the deadline.
    2. exec stops the trainer (``SupervisedService._flush_on_notice``).
    3. ``await_newer_saves``: while the pipeline holds a newer checkpoint of the run than
       the committed one (``SyncPipeline.holds_newer``), until the deadline. A routine
       save written within the slack of the notice counts as its emergency checkpoint
       and may commit first; the trainer's own save for the notice comes after it, and
       exec must not exit before that one commits too (the fleet campaign, #48, lost two
       steps so on a loaded machine). It returns once nothing newer has been in hand for
       ``NEWER_SAVE_QUIET_SECONDS``, long enough for a save the trainer finished just
       before it stopped to be looked at.

Invariant: no wait outlasts the deadline it is given, nor a stop asked for.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from ckptd.daemon.drain import DRAIN_QUIET_SECONDS
from ckptd.notices.responder import Response
from ckptd.runtime.clock import Clock

# After the trainer stopped, nothing newer in hand for this long: no newer save is coming
# (a save's file events are looked at 0.2 s after the burst, ``ckptd.sync.looks``; its
# commit record at once).
NEWER_SAVE_QUIET_SECONDS = 1.0
POLL_SECONDS = 0.1


class Pipeline(Protocol):
    """What the waits need of the first tier's pipeline."""

    def idle(self) -> bool: ...

    def holds_newer(self, run_id: str, name: str) -> bool: ...


class Destination(Protocol):
    """What the waits need of the first tier's health."""

    @property
    def refusal(self) -> Any: ...

    @property
    def error(self) -> str | None: ...


async def await_emergency(
    response: Response | None,
    trainer: asyncio.Task[int],
    *,
    pipeline: Pipeline,
    destination: Destination,
    stop: asyncio.Event,
    clock: Clock,
    deadline: float,
    log: Any,
) -> bool:
    """Step 1 (module doc); True when the emergency checkpoint committed, or when no
    trainer was told (all that is complete is committed)."""
    # Told: signalled, or running without a handler for the signal (spared, it learns
    # from the notice file). Either way a checkpoint may be coming until the deadline.
    told = bool(response and (response.pids or response.skipped))
    quiet_since: float | None = None
    while clock.monotonic() < deadline and not stop.is_set():
        if response is not None and response.done.is_set():
            return True
        if destination.refusal is not None:  # an unreachable store may return
            log.error("exec_flush_impossible", error=destination.error)
            return False
        # The trainer is gone and nothing is left to ship: no checkpoint is coming.
        if (trainer.done() or not told) and pipeline.idle():
            quiet_since = quiet_since or clock.monotonic()
            if clock.monotonic() - quiet_since >= DRAIN_QUIET_SECONDS:
                return not told
        else:
            quiet_since = None
        await asyncio.sleep(POLL_SECONDS)
    return False


async def await_newer_saves(
    response: Response,
    *,
    pipeline: Pipeline,
    stop: asyncio.Event,
    clock: Clock,
    deadline: float,
    log: Any,
) -> None:
    """Step 3 (module doc), once the response's checkpoint committed and the trainer
    stopped."""
    quiet_since = clock.monotonic()
    waited = False  # said once
    while clock.monotonic() < deadline and not stop.is_set():
        run, name = response.run, response.checkpoint
        if run is not None and name is not None and pipeline.holds_newer(run, name):
            if not waited:
                log.info("exec_awaiting_newer_save", run=run, committed=name)
            waited, quiet_since = True, clock.monotonic()
        elif clock.monotonic() - quiet_since >= NEWER_SAVE_QUIET_SECONDS:
            return
        await asyncio.sleep(POLL_SECONDS)
    run, name = response.run, response.checkpoint
    if run is not None and name is not None and pipeline.holds_newer(run, name):
        log.warning("exec_newer_save_not_committed", run=run, committed=name)
