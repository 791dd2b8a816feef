"""The health monitor: every ``[health] poll_interval_seconds`` it reads each source
(``ckptd.health.readers``, in a thread), turns what it read into events (the pure source
modules), decides on each (``ckptd.health.decide``) and hands saves and stops to the
daemon (``Actions``), which knows how to make the trainer save.

A condition that lasts (memory pressure, a cgroup near its limit, a disk too full for
the next save, a store lost) is one event when it begins, not one per poll; it ends
when a reading no longer shows it. Invariant: the node is unhealthy while a degrading
or fatal condition lasts, and from a degrading or fatal fault (an Xid, an OOM kill, an
I/O error) until the daemon restarts: a GPU that faulted once needs someone to look.
A source that cannot be read is said so (``sources``), never an event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ckptd.config.health import HealthConfig
from ckptd.health import dcgm, disk, diskstats, kmsg, memory
from ckptd.health.condition import condition_body, write_condition
from ckptd.health.decide import Decision, Policy, SaveLimit
from ckptd.health.gpu import GpuWatch
from ckptd.health.model import HealthEvent
from ckptd.health.nvml import NvmlReader
from ckptd.health.readers import KmsgReader, device_of, fetch_text, free_bytes, read_small
from ckptd.health.store import Reachability
from ckptd.runtime.metrics import Metrics

# The last events kept for /v1/status and the condition file.
RECENT = 10
DISKSTATS = Path("/proc/diskstats")


@dataclass(frozen=True)
class RunView:
    """What the disk source needs of one watched run."""

    dir: Path
    last_save_bytes: int | None


class Actions(Protocol):
    """What the monitor asks of the daemon (``ckptd.daemon.health_loop``)."""

    def saving(self) -> bool:
        """A save in progress: a notice acted on, or a checkpoint not yet committed."""
        ...

    def trainer_pids(self) -> list[int]: ...

    def notice_committed(self) -> bool:
        """The notice acted on (a save-and-stop's) has its checkpoint committed."""
        ...

    def store(self) -> tuple[bool, str]:
        """Whether the store answered its last check, and its error if not."""
        ...

    def peers(self) -> tuple[bool, str] | None:
        """Whether any of the run's peers answered its last check (None: no peers, or
        none announced), and why not."""
        ...

    def runs(self) -> dict[str, RunView]: ...

    async def save(self, event: HealthEvent) -> bool:
        """The trainer saves and trains on; True once that checkpoint committed."""
        ...

    async def stop(self, event: HealthEvent) -> None:
        """As a notice: save, ship, stop."""
        ...


class HealthMonitor:
    """Reads the sources, decides, acts; its state for status, metrics and the condition
    file."""

    def __init__(
        self,
        config: HealthConfig,
        condition_path: Path,
        actions: Actions,
        metrics: Metrics,
        *,
        wall: Callable[[], float],
        log: Any,
    ) -> None:
        self.config, self.actions, self.metrics, self.wall, self.log = (
            config,
            actions,
            metrics,
            wall,
            log,
        )
        self.condition_path = condition_path
        self.policy = Policy(
            {
                "degrading": config.on_degrading,
                "fatal": config.on_fatal,
                "warning": config.on_warning,
            },
            config.save_interval_seconds,
        )
        self.limit = SaveLimit()
        self.kmsg = KmsgReader(config.kmsg) if config.kmsg else None
        if self.kmsg is not None:
            # Its end now, as the daemon is built: a record written once it said it is
            # ready is read, however late the first poll comes on a loaded machine.
            self.kmsg.open()
        self.reach = Reachability(config.unreachable_seconds)
        self.peer_reach = Reachability(
            config.unreachable_seconds,
            source="peers",
            kind="peers-unreachable",
            what="every peer of the run",
        )
        corrected = config.gpu_corrected_ecc_per_minute
        self.gpus = GpuWatch("dcgm", config.gpu_temperature_celsius, corrected)
        self.nvml = NvmlReader() if config.nvml else None
        self.nvml_gpus = GpuWatch("nvml", config.gpu_temperature_celsius, corrected)
        self.cgroup_events: dict[str, int] | None = None
        self.io: dict[str, diskstats.IoCounts | None] = {}  # each run's device, last poll
        self.active: dict[str, HealthEvent] = {}  # lasting conditions, by key
        self.faults: list[HealthEvent] = []  # degrading or fatal faults since start
        self.recent: deque[HealthEvent] = deque(maxlen=RECENT)
        self.sources: dict[str, str] = {}  # source -> "ok" or why it cannot be read
        self._sources_said: dict[str, bool] = {}  # source -> readable, as last logged
        self.save_task: asyncio.Task[bool] | None = None
        self.save_pending: HealthEvent | None = None  # drain waits for its commit
        self.deferred: dict[str, HealthEvent] = {}  # saves held back by a save, by kind
        self.stop_pending: HealthEvent | None = None  # ... and for a stop's (a notice's)
        self._written: dict[str, Any] | None = None
        metrics.node_healthy.set(1)
        # The series the disk alert takes increase() of, at 0 before its first event.
        metrics.health_events.labels(source=disk.SOURCE, kind="disk-space", severity="warning")

    # -- reading (in a thread) -------------------------------------------------------

    def read(
        self, trainer_pids: Callable[[], list[int]], runs: dict[str, RunView]
    ) -> list[tuple[str, HealthEvent]]:
        """(key, event) for every fault and lasting condition read now; the key of a
        lasting condition is stable while it lasts, a fault's is empty. The trainer's
        PIDs are looked up only when the kernel log names a process it killed."""
        at = self.wall()
        found: list[tuple[str, HealthEvent]] = []
        if self.kmsg is not None:
            lines = self.kmsg.lines()
            pids = trainer_pids() if any(kmsg.KILLED in line for line in lines) else []
            for line in lines:
                event = kmsg.parse_line(line, at, pids)
                if event is not None:
                    found.append(("", event))
            self.sources["kmsg"] = self.kmsg.unreadable or "ok"
        c = self.config
        if c.psi:
            text = read_small(Path(c.psi))
            self.sources["psi"] = "ok" if text is not None else f"cannot read {c.psi}"
            event = memory.pressure_event(c.psi, text or "", c.memory_full_avg10_percent, at)
            if event is not None:
                found.append(("psi:node", event))
        if c.cgroup:
            found += self._read_cgroup(Path(c.cgroup), at)
        if c.dcgm_url:
            text, why = fetch_text(c.dcgm_url)
            readings = dcgm.parse_exporter(text) if text is not None else []
            if text is not None and not readings:
                why = f"{c.dcgm_url} names no GPU (DCGM_FI_DEV_* with a gpu label)"
            self.sources["dcgm"] = "ok" if readings else why
            found += self.gpus.events(readings, at)
        if self.nvml is not None:
            readings = self.nvml.readings()
            self.sources["nvml"] = self.nvml.unreadable or "ok"
            found += self.nvml_gpus.events(readings, at)
        for run, view in runs.items():
            free = free_bytes(view.dir)
            if free is None:
                continue
            self.metrics.health_fs_free_bytes.labels(run=run).set(free)
            event = disk.space_event(
                run, str(view.dir), free, view.last_save_bytes, c.disk_free_factor, at
            )
            if event is not None:
                found.append((f"disk:{run}", event))
        self._read_latency(runs)
        return found

    def _read_latency(self, runs: dict[str, RunView]) -> None:
        """Each watch dir's device's I/O latency since the last poll, as a metric."""
        text = read_small(DISKSTATS)
        for run, view in runs.items():
            device = device_of(view.dir)
            now = diskstats.device_counts(text or "", *device) if device else None
            latency = diskstats.latency_seconds(self.io.get(run), now)
            self.io[run] = now
            if latency is not None:
                self.metrics.health_io_latency.labels(run=run).set(latency)

    def _read_cgroup(self, root: Path, at: float) -> list[tuple[str, HealthEvent]]:
        c, found = self.config, []
        pressure = read_small(root / "memory.pressure")
        events = read_small(root / "memory.events")
        self.sources["cgroup"] = "ok" if events is not None else f"cannot read {root}/memory.events"
        if pressure is not None:
            event = memory.pressure_event(str(root), pressure, c.memory_full_avg10_percent, at)
            if event is not None:
                found.append(("psi:cgroup", event))
        if events is not None:
            self.cgroup_events, event = memory.oom_kill_events(self.cgroup_events, events, at)
            if event is not None:
                found.append(("", event))
        current, limit = read_small(root / "memory.current"), read_small(root / "memory.max")
        if current is not None and limit is not None:
            event = memory.limit_event(current, limit, c.memory_use_ratio, at)
            if event is not None:
                found.append(("limit:cgroup", event))
        return found

    # -- the loop --------------------------------------------------------------------

    async def run(self) -> None:
        """Poll until cancelled; the kernel log is closed at the end."""
        try:
            self.write_condition()
            while True:
                await self.poll()
                await asyncio.sleep(self.config.poll_interval_seconds)
        finally:
            if self.kmsg is not None:
                self.kmsg.close()

    async def poll(self) -> None:
        """One round: read, then handle each new event."""
        read = await asyncio.to_thread(self.read, self.actions.trainer_pids, self.actions.runs())
        reachable, error = self.actions.store()
        lost = self.reach.reading(reachable, error, self.wall())
        if lost is not None:
            read.append(("store", lost))
        peers = self.actions.peers()
        cut = self.peer_reach.reading(*(peers or (True, "")), self.wall())
        if cut is not None:
            read.append(("peers", cut))
        keys = {key for key, _ in read if key}
        if self.reach.lost and "store" in self.active:
            keys.add("store")  # an outage lasts until the store answers
        if self.peer_reach.lost and "peers" in self.active:
            keys.add("peers")  # ... and a node cut off, until a peer does
        for key in [k for k in self.active if k not in keys]:
            ended = self.active.pop(key)
            self.log.info("health_condition_ended", source=ended.source, kind=ended.kind)
        for key, event in read:
            if key and key in self.active:
                continue  # a lasting condition, already heard
            if key:
                self.active[key] = event
            await self.handle(event)
        self.start_deferred()
        self.export()

    def start_deferred(self) -> None:
        """The first save held back by a save, decided again once no save is in progress."""
        if not self.deferred or self.saving():
            return
        kind = next(iter(self.deferred))
        event = self.deferred.pop(kind)
        decision = self.limit.decide(event, self.policy, now=self.wall(), saving=False)
        self.log.warning(
            "health_deferred_decided", kind=kind, action=decision.outcome, why=decision.why
        )
        if decision.outcome == "save":
            self._start_save(event)

    async def handle(self, event: HealthEvent) -> Decision:
        """Count, log and act on one event."""
        self.metrics.health_events.labels(
            source=event.source, kind=event.kind, severity=event.severity
        ).inc()
        if event.severity in ("degrading", "fatal") and not self._lasting(event):
            self.faults.append(event)
        self.recent.append(event)
        decision = self.limit.decide(event, self.policy, now=event.at, saving=self.saving())
        self.metrics.health_actions.labels(action=decision.outcome).inc()
        log = self.log.info if event.severity == "ignore" else self.log.warning
        log(
            "health_event",
            source=event.source,
            kind=event.kind,
            severity=event.severity,
            action=decision.outcome,
            why=decision.why,
            message=event.message,
        )
        if decision.outcome == "save":
            self._start_save(event)
        elif decision.outcome == "defer":
            self.deferred[event.kind] = event  # the latest of its kind
        elif decision.outcome == "save-and-stop":
            self.stop_pending = event
            await self.actions.stop(event)
        self.export()
        return decision

    def _lasting(self, event: HealthEvent) -> bool:
        return any(e is event for e in self.active.values())

    def _start_save(self, event: HealthEvent) -> None:
        self.save_pending = event
        self.log.warning("health_save_started", kind=event.kind, source=event.source)
        self.save_task = asyncio.create_task(self._save(event), name="health-save")

    async def _save(self, event: HealthEvent) -> bool:
        committed = False
        try:
            committed = await self.actions.save(event)
        finally:
            if self.save_pending is event:
                self.save_pending = None
            self.log.warning(
                "health_save_done" if committed else "health_save_not_committed",
                kind=event.kind,
                source=event.source,
            )
            self.export()
        return committed

    def saving(self) -> bool:
        own = self.save_task is not None and not self.save_task.done()
        return own or self.actions.saving()

    # -- what others see -------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        lasting = any(e.severity in ("degrading", "fatal") for e in self.active.values())
        return not lasting and not self.faults

    def export(self) -> None:
        """The gauges, and the condition file when what it says changed."""
        if self.stop_pending is not None and self.actions.notice_committed():
            self.stop_pending = None
        self.metrics.node_healthy.set(1 if self.healthy else 0)
        for name, state in self.sources.items():
            self.metrics.health_source_up.labels(source=name).set(1 if state == "ok" else 0)
        self.say_sources()
        self.write_condition()

    def say_sources(self) -> None:
        """One log line when a source turns unreadable (``health_source_unreadable``, with
        why: an enabled source that cannot be read is never silent) and one when it is
        readable again; none per poll."""
        for name, state in self.sources.items():
            readable = state == "ok"
            if self._sources_said.get(name, True) != readable:
                if readable:
                    self.log.info("health_source_readable", source=name)
                else:
                    self.log.warning("health_source_unreadable", source=name, why=state)
            self._sources_said[name] = readable

    def write_condition(self) -> None:
        seen = [*self.faults, *self.active.values()]
        # The reason to drain: the last fatal fault, else the last degrading one.
        fatal = [e for e in seen if e.severity == "fatal"]
        ranked = fatal or [e for e in seen if e.severity == "degrading"]
        worst = ranked[-1] if ranked else None
        healthy = self.healthy
        body = condition_body(
            healthy,
            # Drain once the save for the fault is off the node, not before.
            drain=not healthy and self.save_pending is None and self.stop_pending is None,
            reason="Healthy" if worst is None or healthy else f"{worst.source}:{worst.kind}",
            message="" if worst is None or healthy else worst.message,
            events=[e.to_json() for e in self.recent],
        )
        if body == self._written:
            return
        try:
            write_condition(self.condition_path, body, self.wall())
        except OSError as exc:
            self.log.warning(
                "health_condition_not_written", path=str(self.condition_path), error=str(exc)
            )
            return
        self._written = body

    def status(self) -> dict[str, Any]:
        """``/v1/status``'s ``health``."""
        last = self.recent[-1].to_json() if self.recent else None
        return {
            "healthy": self.healthy,
            "sources": dict(self.sources),
            "saving": self.save_pending is not None or self.stop_pending is not None,
            "deferred": sorted(self.deferred),
            "conditions": [e.to_json() for e in self.active.values()],
            "faults": len(self.faults),
            "last_event": last,
            "condition_file": str(self.condition_path),
        }

    async def close(self) -> None:
        if self.save_task is not None:
            self.save_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.save_task
        if self.kmsg is not None:
            self.kmsg.close()  # opened when built, whether or not it ran
