"""The training's own health in the daemon: every watched run's reported losses
(``ckptd.trainer.report_step(step, loss=...)``) judged by the loss-spike rule
(``ckptd.health.loss``), and the rollback target kept.

On a spike or a non-finite loss at step S, the newest committed checkpoint of the run's
live trajectory whose step is below S is protected: a lease with an ``until`` under
``<run>/.ckptd-restoring/`` (``Repository.take_lease``), which every node's retention and
``ckptd prune`` honour as they honour a restore's, for ``[health] protect_hours``. A
non-finite loss in a spike's episode protects the newest checkpoint below its own step
too. A spike before any checkpoint below its step is committed protects the first one
that commits, and a checkpoint below the spike that commits after it (it was still
shipping) becomes the target in its place: the event is looked at again every poll until
a checkpoint at or above its step is committed on the line. When the loss is back (the
rule's ``stable``) this daemon releases the protections it took; otherwise they run out
by themselves, and retention removes them once stale. A target protected already (by this daemon before a restart, which reads the
ring again from its start, or by another node's) is adopted, not protected twice: its
``until`` stands.

From a non-finite loss at step N until the episode ends, or until the trainer reports a
step below N (it rolled back), each checkpoint committed at step N or later is
``suspect`` in its manifest: each tier's shipper asks ``suspect`` before it commits, which
reads the ring first. The watch also tells the cadence advisor when the loss turns
volatile and when it is back (``on_volatile``).

The rings are read every ``[health] poll_interval_seconds``; where a trainer could not
map one, the last loss of its ``steps.json`` is judged instead (a sample every few
seconds).

Invariant: the watch never holds the daemon back and never deletes a checkpoint: a ring
that cannot be read is no loss, and a store that fails a protection is logged and tried
again at the next poll, for as long as the episode lasts.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.commit.lineage import abandoned
from ckptd.config.health import HealthConfig
from ckptd.goodput.step_report import read_json_loss, read_losses
from ckptd.health.loss import LossEvent, LossRule, LossTracker
from ckptd.repository import Repository
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics

__all__ = ["LossWatch", "RunLosses", "build_loss_watch"]


@dataclass
class RunLosses:
    """One run's losses as the watch follows them."""

    dir: Path
    tracker: LossTracker
    after: int = 0  # the last report read from the ring
    last: tuple[int, float] | None = None  # (step, loss) of the newest report
    pending: list[LossEvent] = field(default_factory=list)  # targets not protected yet
    protected: dict[str, str] = field(default_factory=dict)  # checkpoint -> lease key
    targets: dict[int, str] = field(default_factory=dict)  # an event's step -> its target
    spikes: list[dict[str, Any]] = field(default_factory=list)  # the last few events
    nonfinite_at: int | None = None  # the step of the open episode's first non-finite loss
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one reader of the ring
    release_due: bool = False  # the loss came back: release the protections
    json_seen: int = 0  # the steps.json loss last taken (its time, in microseconds)


class LossWatch:
    """Every watched run's losses (module doc)."""

    def __init__(
        self,
        health: HealthConfig,
        watch_dirs: Mapping[str, Path],
        repo: Repository,
        metrics: Metrics,
        clock: Clock,
        log: Any,
    ) -> None:
        rule = LossRule(health.loss_window, health.loss_z, health.loss_min_reports)
        self.runs = {run: RunLosses(Path(d), LossTracker(rule)) for run, d in watch_dirs.items()}
        self.protect_seconds = health.protect_hours * 3600.0
        # Read as often as the health sources; a ring holds 4096 reports, so a trainer at
        # under ~1000 steps a second loses none between two reads at the default 2 s.
        self.every = health.poll_interval_seconds
        self.repo, self.metrics, self.clock, self.log = repo, metrics, clock, log
        # Told when a run's loss turns volatile or comes back (the cadence advisor).
        self.on_volatile: Callable[[str, bool], None] = lambda run, volatile: None
        for run in self.runs:
            metrics.protected_checkpoints.labels(run=run).set(0)
            for kind in ("spike", "non-finite"):
                metrics.loss_spikes.labels(run=run, kind=kind)

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.every)

    async def poll(self) -> None:
        """Read each run's new losses, judge them, and protect or release."""
        for run_id, state in self.runs.items():
            await self._catch_up(run_id, state)
            for event in list(state.pending) if self.protect_seconds > 0 else []:
                await self._protect(run_id, state, event)

    async def _catch_up(self, run_id: str, state: RunLosses) -> None:
        async with state.lock:
            reports, state.after = await asyncio.to_thread(read_losses, state.dir, state.after)
            if not reports and not state.after:  # no ring: the steps.json fallback's, sampled
                sample = await asyncio.to_thread(read_json_loss, state.dir)
                if sample is not None and sample.n != state.json_seen:
                    state.json_seen, reports = sample.n, [sample]
            for report in reports:
                state.last = (report.step, report.loss)
                if state.nonfinite_at is not None and report.step < state.nonfinite_at:
                    state.nonfinite_at = None  # the trainer went back to before it: a rollback
                event = state.tracker.observe(report.step, report.loss)
                if event is not None:
                    self._on_event(run_id, state, event)
            if reports:
                self.on_volatile(run_id, state.tracker.volatile)
        if state.release_due:
            state.release_due = False
            await self._release(run_id, state)

    async def suspect(self, run_id: str, step: int | None) -> str | None:
        """Why a checkpoint of ``run_id`` at ``step`` being committed now is suspect: saved
        at or after a non-finite loss of the open episode (the ring read first, so a NaN
        reported before the save is seen); None otherwise, and for a run not watched."""
        state = self.runs.get(run_id)
        if state is None or step is None:
            return None
        try:
            await self._catch_up(run_id, state)
        except Exception as exc:  # noqa: BLE001 - a commit never fails for the loss watch
            self.log.warning("loss_ring_unread", run=run_id, error=str(exc))
        since = state.nonfinite_at
        if since is None or step < since:
            return None
        return f"saved after a non-finite loss at step {since}"

    def _on_event(self, run_id: str, state: RunLosses, event: LossEvent) -> None:
        self.log.warning(
            "loss_" + event.kind.replace("-", "_"),
            run=run_id,
            step=event.step,
            loss=event.loss,
            mean=event.mean,
            std=event.std,
            z=event.z,
        )
        state.spikes = [*state.spikes[-4:], _event_json(event, self.clock.time())]
        if event.kind == "non-finite":
            state.nonfinite_at = event.step
        if event.kind == "stable":
            state.pending.clear()
            state.targets.clear()
            state.nonfinite_at = None
            state.release_due = True  # after the ring's lock: a commit may be waiting on it
            return
        self.metrics.loss_spikes.labels(run=run_id, kind=event.kind).inc()
        state.pending.append(event)  # protected at the end of this poll (or a later one)

    async def _protect(self, run_id: str, state: RunLosses, event: LossEvent) -> None:
        try:
            target, passed = await asyncio.to_thread(self._target, run_id, event.step)
            if target is None:
                return  # nothing below the spike committed yet: the next poll looks again
            if state.targets.get(event.step) == target:
                if passed:  # nothing newer below the spike can commit now
                    state.pending.remove(event)
                return
            now = self.clock.time()
            held: dict[str, str] = {}
            read = functools.partial(self.repo.read_protections, run_id, now=now, keys=held)
            await asyncio.to_thread(read)
            if target in held:  # this daemon's before a restart, or another node's: adopted
                state.protected.setdefault(target, held[target])
            elif target not in state.protected:
                key = await asyncio.to_thread(
                    self.repo.take_lease,
                    run_id,
                    target,
                    now=now,
                    until=now + self.protect_seconds,
                    why="loss-spike" if event.kind == "spike" else "non-finite",
                    detail={"step": event.step, "loss": repr(event.loss)},
                )
                state.protected[target] = key
                self.log.warning(
                    "rollback_target_protected",
                    run=run_id,
                    checkpoint=target,
                    spike_step=event.step,
                    hours=self.protect_seconds / 3600,
                )
            await self._move(run_id, state, event.step, target)
            if passed:
                state.pending.remove(event)
        except Exception as exc:  # noqa: BLE001 - the store's faults: tried again next poll
            self.log.warning("rollback_target_not_protected", run=run_id, error=str(exc))
        self.metrics.protected_checkpoints.labels(run=run_id).set(len(state.protected))

    async def _move(self, run_id: str, state: RunLosses, step: int, target: str) -> None:
        """``target`` is now the event at ``step``'s; its previous target, if no other
        event keeps it, is released (a newer checkpoint below the spike committed)."""
        old = state.targets.get(step)
        state.targets[step] = target
        if old is None or old in state.targets.values() or old not in state.protected:
            return
        await asyncio.to_thread(self.repo.release_lease, state.protected.pop(old))
        self.log.info("rollback_target_moved", run=run_id, released=old, checkpoint=target)

    def _target(self, run_id: str, step: int) -> tuple[str | None, bool]:
        """The newest committed checkpoint on the live line whose step is below ``step``,
        and whether one at or above ``step`` is committed there already."""
        committed = [c.manifest for c in self.repo.list_committed(run_id)]
        latest = self.repo.read_latest(run_id)
        off_line = abandoned(committed, latest.checkpoint if latest is not None else None)
        before = [
            m
            for m in committed
            if m.step is not None and m.step < step and m.checkpoint not in off_line
        ]
        passed = any(
            m.step is not None and m.step >= step and m.checkpoint not in off_line
            for m in committed
        )
        return (before[-1].checkpoint if before else None), passed

    async def _release(self, run_id: str, state: RunLosses) -> None:
        for name, key in list(state.protected.items()):
            try:
                await asyncio.to_thread(self.repo.release_lease, key)
            except Exception as exc:  # noqa: BLE001 - it runs out by itself
                self.log.warning("protection_not_released", run=run_id, error=str(exc))
            else:
                self.log.info("rollback_target_released", run=run_id, checkpoint=name)
            del state.protected[name]
        self.metrics.protected_checkpoints.labels(run=run_id).set(0)

    def status(self) -> dict[str, Any]:
        """Per run, for ``/v1/status`` ``loss`` (``ckptd status``'s line)."""
        out = {}
        for run_id, state in self.runs.items():
            if state.last is None:
                continue
            out[run_id] = {
                "step": state.last[0],
                "loss": _number(state.last[1]),
                "volatile": state.tracker.volatile,
                "suspect_from_step": state.nonfinite_at,
                "protected": sorted(state.protected),
                "events": state.spikes,
            }
        return out


def _number(value: float) -> float | str:
    """A loss for JSON: NaN and infinities as text."""
    return value if value == value and abs(value) != float("inf") else repr(value)


def _event_json(event: LossEvent, now: float) -> dict[str, Any]:
    return {"kind": event.kind, "step": event.step, "loss": _number(event.loss), "at": now}


def build_loss_watch(service: Any) -> LossWatch:
    """The watch of every run ``service`` (``ckptd.daemon.service``) ships, in its first
    tier's store; every tier's shipper asks it whether a checkpoint is suspect."""
    runs = service.pipeline.runs
    watch = LossWatch(
        service.settings.health,
        {run_id: Path(state.dir) for run_id, state in runs.items()},
        service.pipeline.repo,
        service.metrics,
        service.clock,
        service.log,
    )
    for tier in service.tiers:
        tier.pipeline.shipper.suspect_of = watch.suspect
    watch.on_volatile = service.advisor.set_volatile
    return watch
