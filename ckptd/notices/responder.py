"""Acting on a preemption notice; knows no cloud.

Within one poll interval of a notice the responder
  1. writes ``<watch dir>/.ckptd/preemption.json`` (atomically) for every watched run,
  2. sends ``trainer.signal`` to the trainer (pidfile, or every process whose command
     line contains ``trainer.match`` — every rank on the node; ``ckptd exec``: its
     trainer's tree), but only to a process that has a handler for it (``SigCgt``): a
     launcher such as torchrun, or a pager on the script, would die of it. A process
     spared is logged once (``trainer_signal_skipped``, with its command line) and
     counted (``ckptd_trainer_signal_skipped_total``),
  3. answers ``GET /v1/preemption`` with the same JSON,
  4. puts the pipeline in emergency mode: the first checkpoint completed after the
     notice jumps the queue, and an older upload that cannot also finish is paused,
  5. once that checkpoint is committed, acknowledges the notice (Azure StartRequests)
     and logs the timings noticed -> signalled -> complete -> committed; an emergency
     commit of a higher step of the same run after it becomes the response's checkpoint
     (the first may be a routine save finished around the notice).
One notice is acted on once (deduplicated by id) and logged once (``notice_received``);
the same id again with another deadline (a time the cloud restated) moves the deadline of
the notice being acted on, and nothing else: no second signal, and the emergency keeps
its start, so the checkpoint saved for the notice stays its emergency checkpoint. A
cancelled one clears the state.
With peer replication the checkpoint is *safe off the node* at the first of: ``copies``
peers acknowledged it verified (``on_safe``), this node's part is in the store
(``on_safe`` from the pipeline), or it committed; the timings say which and when.
With many nodes, a notice of this node's own is also handed to ``publish_notice`` (the
cluster's NOTICE, ``ckptd.notices.cluster``), which only schedules the write: the
trainer's signal never waits for the store. A notice followed from another node is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from ckptd.config import Settings
from ckptd.core import handoff
from ckptd.layouts.base import step_of
from ckptd.notices import carried
from ckptd.notices.model import Notice, NoticeSource, format_time
from ckptd.runtime.clock import SYSTEM_CLOCK, Clock
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics
from ckptd.runtime.processes import catches_signal, cmdline_of

NOTICE_FILE = handoff.NOTICE


def _is_ckptd(argv: list[str]) -> bool:
    """A ckptd process (this daemon, `ckptd drill`, ...): never the trainer."""
    if not argv:
        return False
    if os.path.basename(argv[0]) == "ckptd":
        return True
    return any(a == "-m" and b.split(".")[0] == "ckptd" for a, b in itertools.pairwise(argv))


def find_trainer_pids(pidfile: str, match: str, *, proc: Path = Path("/proc")) -> list[int]:
    """PIDs of the trainer: from ``pidfile``, or every process whose command line
    contains ``match`` (all ranks on the node), never ckptd itself or its parent."""
    if pidfile:
        try:
            pid = int(Path(pidfile).read_text().strip())
        except (OSError, ValueError):
            return []
        return [pid] if pid > 0 else []
    if not match:
        return []
    own = {os.getpid(), os.getppid()}
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in own:
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited, or not ours to read
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if match in " ".join(argv) and not _is_ckptd(argv):
            found.append(int(entry.name))
    return sorted(found)


def write_notice_file(watch_dir: Path, body: dict[str, Any]) -> Path:
    """Write the notice file under ``watch_dir/.ckptd/`` by rename, so a reader never
    sees half of it."""
    target = watch_dir / NOTICE_FILE
    target.parent.mkdir(exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, target)
    return target


@dataclass
class Response:
    """One notice being acted on, and when each step happened (monotonic seconds)."""

    notice: Notice
    source: NoticeSource | None
    noticed: float
    signalled: float | None = None
    pids: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    complete: float | None = None
    committed: float | None = None
    checkpoint: str | None = None
    run: str | None = None
    bytes: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # The cluster NOTICE write for this notice (many nodes, a notice of our own only).
    published: asyncio.Task[bool] | None = None
    # Safe off the node (peer replication): when, and how first ("peer" | "store"); when
    # peers acknowledged it, and when this node's part was in the store.
    safe: float | None = None
    safe_via: str | None = None
    replicated: float | None = None
    stored: float | None = None
    safe_peers: list[str] = field(default_factory=list)

    def timings(self, now: datetime) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - self.noticed, 3)

        left = self.notice.seconds_left(now)
        return {
            "notice": self.notice.to_json(),
            "signalled_after_s": rel(self.signalled),
            "trainer_pids": self.pids,
            # Matched but spared: no handler for the signal (it would have died of it).
            "skipped_pids": self.skipped,
            "checkpoint": self.checkpoint,
            "run": self.run,
            "bytes": self.bytes,
            "complete_after_s": rel(self.complete),
            "committed_after_s": rel(self.committed),
            "seconds_left_at_commit": None
            if self.committed is None or left is None
            else round(left, 3),
            "committed_before_deadline": None
            if self.committed is None
            else (self.notice.deadline is None or (left is not None and left >= 0)),
            # Peer replication: safe off the node, first by peers or by the store.
            "safe_after_s": rel(self.safe),
            "safe_via": self.safe_via,
            "replicated_after_s": rel(self.replicated),
            "stored_after_s": rel(self.stored),
            "safe_peers": self.safe_peers,
            "safe_before_deadline": None
            if self.safe is None
            else (
                self.notice.deadline is None
                or self.notice.noticed_at.timestamp() + (self.safe - self.noticed)
                <= self.notice.deadline.timestamp()
            ),
            # Many nodes: whether <run>/NOTICE was written (None: one node, or followed).
            "notice_published": None
            if self.published is None
            else bool(
                self.published.done()
                and not self.published.cancelled()
                and self.published.exception() is None
                and self.published.result()
            ),
        }


class EmergencyMode(Protocol):
    """What the responder needs of the pipeline: where to write notice files, and a
    switch for emergency mode (module doc, step 4)."""

    def watch_dirs(self) -> list[Path]: ...

    def enter_emergency(self, deadline: datetime | None, since: float | None = None) -> None: ...

    def move_deadline(self, deadline: datetime | None) -> None: ...

    def leave_emergency(self) -> None: ...


class Responder:
    """Turns Notices into actions; the pipeline calls ``on_commit`` after each commit."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        pipeline: EmergencyMode,
        *,
        clock: Clock = SYSTEM_CLOCK,
        trainer_pids: Callable[[], list[int]] | None = None,
    ) -> None:
        self.settings = settings
        # `ckptd exec` knows its trainer: it replaces the pidfile / cmdline-match lookup.
        self.trainer_pids = trainer_pids
        self.metrics = metrics
        self.pipeline = pipeline
        self.clock = clock
        self.current: Response | None = None
        self.handled: set[str] = set()
        self.skipped_logged: set[int] = set()  # PIDs already logged as spared
        self._background: set[asyncio.Task[None]] = set()
        self._files_lock = asyncio.Lock()  # notice-file writes and removals, in order
        self.log = get_logger()
        # Set by the service with many nodes: schedules the cluster NOTICE write.
        self.publish_notice: Callable[[Notice], asyncio.Task[bool]] | None = None
        # Where a notice acted on is carried across a restart (``ckptd.notices.carried``).
        self.state_dir = Path(settings.state.dir)
        # When the last drill's notice came (wall) and was cleared (monotonic): ckptd exec.
        self.drill_noticed: float | None = None
        self.drill_ended: float | None = None

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock.time(), UTC)

    def preemption_json(self) -> dict[str, Any]:
        """What ``GET /v1/preemption`` answers."""
        if self.current is None:
            return {"notice": False}
        r = self.current
        safe = {}
        if r.safe is not None:  # peer replication: safe off the node, and how first
            safe = {"safe_via": r.safe_via, "safe_after_s": round(r.safe - r.noticed, 3)}
        return {"notice": True, **r.notice.to_json(), **safe}

    async def handle(
        self, notice: Notice, source: NoticeSource | None = None, *, publish: bool = True
    ) -> Response | None:
        """Act on one notice (once per id); ``publish=False`` for one followed from another
        node, which must not be published again."""
        if self._not_new(notice):
            return None
        self.handled.add(notice.id)
        response = Response(notice, source, self.clock.monotonic())
        self.current = response
        if notice.kind == "drill":
            self.drill_noticed = notice.noticed_at.timestamp()
        elif notice.kind in carried.ENDS_BY_ITSELF:
            self.drill_noticed = None  # a health save: no drill's cost to book
        body = notice.to_json()
        self.log.warning(
            "notice_received",
            source=notice.source,
            kind=notice.kind,
            id=notice.id,
            deadline=body["deadline"],
            seconds_left=notice.seconds_left(self._now()),
            detail=body["detail"],
        )
        self.metrics.preemption_notice.set(1)
        if notice.deadline is not None:
            self.metrics.preemption_deadline.set(notice.deadline.timestamp())
        if publish and self.publish_notice is not None:
            # Only schedules: the write runs in a thread beside the signalling below.
            response.published = self.publish_notice(notice)
        # The signal first: it is what makes the trainer save. Writing the notice file
        # can stall on a busy disk (a rename over an old file issues a synchronous
        # discard on ext4 with `discard`), so it goes second and does not hold up the
        # poller (measured by bench/bench_preemption.py).
        trainer = self.settings.trainer
        signum = trainer.signal_number

        def targets() -> list[tuple[int, bool]]:
            """Each matched PID, and whether it handles the signal (one thread hop)."""
            if self.trainer_pids is not None:
                found = self.trainer_pids()
            else:
                found = find_trainer_pids(trainer.pidfile, trainer.match)
            return [(pid, catches_signal(pid, signum)) for pid in found]

        for pid, handled in await asyncio.to_thread(targets):
            if not handled:
                self._spare(pid, trainer.signal)
                response.skipped.append(pid)
                continue
            try:
                os.kill(pid, signum)
                response.pids.append(pid)
            except OSError as exc:
                self.log.error("trainer_signal_failed", pid=pid, error=str(exc))
        response.signalled = self.clock.monotonic() if response.pids else None
        if response.pids:
            self.log.warning("trainer_signalled", pids=response.pids, signal=trainer.signal)
        elif response.skipped:
            self.log.error(
                "trainer_not_signalled",
                skipped=response.skipped,
                why=f"no matched process handles {trainer.signal}; the notice file and "
                "/v1/preemption still carry the notice",
            )
        elif trainer.pidfile or trainer.match or self.trainer_pids is not None:
            self.log.error("trainer_not_found", pidfile=trainer.pidfile, match=trainer.match)
        task = asyncio.get_running_loop().create_task(self._write_notice_files(body))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        # One followed from another node began at its origin: the trainer may have saved
        # for it before this daemon heard of it (through the store), and that save is the
        # emergency checkpoint.
        origin = None if publish else min(self.clock.time(), notice.noticed_at.timestamp())
        self.pipeline.enter_emergency(notice.deadline, since=origin)
        try:
            await asyncio.to_thread(carried.record, self.state_dir, notice, response.pids)
        except OSError as exc:
            self.log.warning("notice_not_carried", error=str(exc))
        return response

    def carry_on(self, notice: Notice, pids: list[int]) -> Response:
        """An earlier daemon acted on ``notice`` and it is still in force
        (``ckptd.notices.carried``): handled already, so its source's repeats signal no one;
        emergency mode from the notice's own time."""
        self.handled.add(notice.id)
        response = Response(notice, None, self.clock.monotonic())
        response.pids = list(pids)
        response.signalled = response.noticed if pids else None
        self.current = response
        self.metrics.preemption_notice.set(1)
        if notice.deadline is not None:
            self.metrics.preemption_deadline.set(notice.deadline.timestamp())
        self.pipeline.enter_emergency(notice.deadline, since=notice.noticed_at.timestamp())
        self.log.warning(
            "notice_carried_over",
            source=notice.source,
            kind=notice.kind,
            id=notice.id,
            seconds_left=notice.seconds_left(self._now()),
            signalled_before=pids,
        )
        return response

    def _not_new(self, notice: Notice) -> bool:
        """Whether ``notice`` is no new notice: a cancellation (of the current one: it is
        cleared), or one already handled (the current one restated: its deadline moves)."""
        current = self.current if self.current and self.current.notice.id == notice.id else None
        if notice.cancelled:
            if current is not None:
                self.log.info("notice_cancelled", source=notice.source, id=notice.id)
                self.clear()
            return True
        if notice.id in self.handled:
            if current is not None:
                self._move_deadline(notice)
            return True
        return False

    def _move_deadline(self, update: Notice) -> None:
        """The notice being acted on, restated with another deadline: the deadline moves
        (``/v1/preemption``, the notice files, the flush's plan); it stays one notice."""
        current = self.current
        assert current is not None
        if update.deadline == current.notice.deadline:
            return
        current.notice = replace(current.notice, deadline=update.deadline)
        self.log.debug(
            "notice_deadline_moved",
            source=update.source,
            id=update.id,
            deadline=current.notice.to_json()["deadline"],
        )
        self.metrics.preemption_deadline.set(
            update.deadline.timestamp() if update.deadline is not None else 0
        )
        self.pipeline.move_deadline(update.deadline)
        task = asyncio.get_running_loop().create_task(
            self._write_notice_files(current.notice.to_json())
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _spare(self, pid: int, signal_name: str) -> None:
        """A matched process with no handler for the signal: never signalled; logged
        once per PID, counted every time."""
        self.metrics.trainer_signal_skipped.inc()
        if pid in self.skipped_logged:
            return
        self.skipped_logged.add(pid)
        self.log.warning(
            "trainer_signal_skipped",
            pid=pid,
            cmdline=cmdline_of(pid),
            signal=signal_name,
            why="it has no handler for the signal, whose default action would end it",
        )

    async def _write_notice_files(self, body: dict[str, Any]) -> None:
        async with self._files_lock:
            for watch_dir in self.pipeline.watch_dirs():
                try:
                    await asyncio.to_thread(write_notice_file, watch_dir, body)
                except OSError as exc:
                    self.log.error("notice_file_failed", dir=str(watch_dir), error=str(exc))

    def on_complete(self, run: str, name: str) -> None:
        """The pipeline found the emergency checkpoint complete."""
        r = self.current
        if r is not None and r.complete is None:
            r.complete, r.checkpoint, r.run = self.clock.monotonic(), name, run

    def on_safe(
        self, run: str, name: str, via: str, emergency: bool, detail: dict[str, Any]
    ) -> None:
        """This node's part of a checkpoint is safe off the node: acknowledged by
        ``peers.copies`` peers (``via`` "peer") or in the store ("store"). For the
        emergency checkpoint, the first of them makes the response safe."""
        r = self.current
        if r is None or not emergency:
            return
        now = self.clock.monotonic()
        if via == "peer" and r.replicated is None:
            r.replicated = now
            r.safe_peers = list(detail.get("peers", []))
        elif via == "store" and r.stored is None:
            r.stored = now
        if r.safe is not None:
            return
        r.safe, r.safe_via = now, via
        if r.checkpoint is None:
            r.checkpoint, r.run = name, run
        self.metrics.emergency_safe_seconds.labels(via=via).set(round(now - r.noticed, 3))
        left = r.notice.seconds_left(self._now())
        self.log.warning(
            "emergency_checkpoint_safe",
            run=run,
            checkpoint=name,
            via=via,
            after_s=round(now - r.noticed, 3),
            seconds_left=None if left is None else round(left, 3),
            **detail,
        )

    async def on_commit(self, run: str, name: str, total_bytes: int, emergency: bool) -> None:
        """A checkpoint was committed; if it was the emergency one, finish the response."""
        r = self.current
        if r is None or not emergency:
            return
        if r.committed is not None:
            self._superseded(r, run, name, total_bytes)
            return
        self.on_safe(run, name, "store", emergency, {})
        r.committed = self.clock.monotonic()
        r.checkpoint, r.run, r.bytes = name, run, total_bytes
        if r.complete is None:
            r.complete = r.committed
        timings = r.timings(self._now())
        self.log.warning(
            "emergency_checkpoint_committed", **{k: v for k, v in timings.items() if k != "notice"}
        )
        if r.source is not None:
            try:
                await r.source.acknowledge(r.notice)
            except Exception as exc:  # noqa: BLE001 - an ack failure must not stop the flush
                self.log.error("notice_ack_failed", source=r.notice.source, error=str(exc))
        r.done.set()

    def _superseded(self, r: Response, run: str, name: str, total_bytes: int) -> None:
        """A newer save of the run committed after the response's emergency checkpoint
        (that one was a routine save written within the slack of the notice; the
        trainer's own save for it came after): the response now names the newer one."""
        step, current = step_of(name), step_of(r.checkpoint or "")
        if run != r.run or step is None or (current is not None and step <= current):
            return
        older = r.checkpoint
        r.committed = self.clock.monotonic()
        r.checkpoint, r.bytes = name, total_bytes
        self.log.warning(
            "emergency_checkpoint_superseded",
            run=run,
            checkpoint=name,
            older=older,
            committed_after_s=round(r.committed - r.noticed, 3),
        )

    def drilling(self, within: float) -> bool:
        """Whether a notice that ends by itself is current (a drill's, this node's or
        another's followed here; a health save's, ``ckptd.daemon.health_loop``), or one
        ended less than ``within`` seconds ago: a trainer that stops now stopped because
        it was asked to save, not to stop (``ckptd exec`` starts it again)."""
        if self.current is not None and self.current.notice.kind in carried.ENDS_BY_ITSELF:
            return True
        ended = self.drill_ended
        return ended is not None and self.clock.monotonic() - ended < within

    async def settle(self) -> None:
        """Return once the notice files' writes and removals scheduled so far are done."""
        await asyncio.gather(*self._background, return_exceptions=True)

    def clear(self) -> None:
        """Forget the current notice (cancelled, or a drill that ended)."""
        if self.current is not None and self.current.notice.kind in carried.ENDS_BY_ITSELF:
            self.drill_ended = self.clock.monotonic()
        self.current = None
        self.metrics.preemption_notice.set(0)
        self.metrics.preemption_deadline.set(0)
        self.pipeline.leave_emergency()
        carried.forget(self.state_dir)
        paths = [watch_dir / NOTICE_FILE for watch_dir in self.pipeline.watch_dirs()]

        def unlink_all() -> None:
            for path in paths:
                path.unlink(missing_ok=True)

        async def unlink_in_order() -> None:
            # Off the event loop (an unlink can stall on a busy disk like the write), and
            # in order with the writes, so a newer notice's file is never removed.
            async with self._files_lock:
                await asyncio.to_thread(unlink_all)

        task = asyncio.get_running_loop().create_task(unlink_in_order())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drill(self, deadline_seconds: float) -> dict[str, Any]:
        """A simulated notice end to end; returns the timings (``ckptd drill``)."""
        now = self._now()
        notice = Notice(
            source="drill",
            kind="drill",
            id=f"drill:{format_time(now)}",
            noticed_at=now,
            deadline=now + timedelta(seconds=deadline_seconds),
        )
        response = await self.handle(notice)
        assert response is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(response.done.wait(), timeout=deadline_seconds)
        result = response.timings(self._now())
        self.clear()
        return result
