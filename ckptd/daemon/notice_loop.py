"""The notice loop: every notice source, SIGTERM's included, through one loop into the
responder, by the many-node rules.

A source never ends the daemon: one that fails is listened to again after the poll
interval. What a notice means for the daemon's life (stop, flush, hold the trainer) is
the lifecycle's call, ``react``; this loop finds the sources, follows them, and hands
each notice on. With many nodes another node's notice is acted on but never published
again (no echo), and skipped while this node already responds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptd.cadence.advisor import CadenceAdvisor
from ckptd.config import Settings
from ckptd.notices.cluster import ClusterNoticeSource
from ckptd.notices.detect import make_source
from ckptd.notices.health import SourceHealth
from ckptd.notices.model import Notice, NoticeSource
from ckptd.notices.responder import NOTICE_FILE, Responder, Response
from ckptd.notices.shutdown import sigterm_meaning
from ckptd.notices.slurm import make_slurm_source
from ckptd.notices.slurm_job import lead_seconds
from ckptd.runtime.clock import Clock
from ckptd.runtime.metrics import Metrics

# What the lifecycle does with one notice from one source.
Reaction = Callable[[Notice, NoticeSource], Awaitable[None]]


class NoticeLoop:
    """Follows the notice sources and routes each notice to ``react``."""

    def __init__(
        self,
        settings: Settings,
        responder: Responder,
        advisor: CadenceAdvisor,
        *,
        cluster_source: ClusterNoticeSource | None,
        react: Reaction,
        clock: Clock,
        log: Any,
    ) -> None:
        self.settings = settings
        self.responder = responder
        self.advisor = advisor
        self.cluster_source = cluster_source
        self.react = react
        self.clock = clock
        self.log = log
        self._followed_drills: set[asyncio.Task[None]] = set()
        self.cloud = self._cloud_source()
        self.slurm = self._slurm_source()

    def _cloud_source(self) -> NoticeSource | None:
        """The cloud's notice source, if any (made once: construction does no I/O)."""
        p = self.settings.preemption
        try:
            cloud = make_source(p.provider, p.endpoint, p.poll_interval_seconds, p.imdsv1_fallback)
        except (ValueError, OSError) as exc:
            self.log.error("notice_source_unavailable", provider=p.provider, error=str(exc))
            return None
        self.log.info("notice_source", provider=p.provider, source=cloud and cloud.name)
        return cloud

    def _slurm_source(self) -> NoticeSource | None:
        """The Slurm job's source inside a Slurm job (``SLURM_JOB_ID``), else None."""
        s = self.settings.slurm
        slurm = make_slurm_source(
            s.enabled,
            os.environ,
            lead=self.slurm_lead,
            poll_interval=s.poll_interval_seconds,
            signal_name=s.signal,
        )
        if slurm is not None:
            self.log.info("notice_source", provider="slurm", job=slurm.job_id)
        return slurm

    def sources(self, fixed: list[NoticeSource]) -> list[NoticeSource]:
        """``fixed`` (the signals, another node's NOTICE), then the cloud's and the Slurm
        job's, where there are."""
        return [*fixed, *(s for s in (self.cloud, self.slurm) if s is not None)]

    def health(self) -> dict[str, SourceHealth]:
        """The health of each source that asks something outside the daemon (a cloud's
        metadata service, Slurm's controller), by name."""
        found = (getattr(source, "health", None) for source in (self.cloud, self.slurm))
        return {h.source: h for h in found if isinstance(h, SourceHealth)}

    def export_health(self, metrics: Metrics) -> dict[str, Any]:
        """Each source's health into ``metrics``; returns it for ``/v1/status``."""
        out = {}
        for name, health in self.health().items():
            metrics.notice_source_up.labels(source=name).set(1 if health.up else 0)
            metrics.notice_source_last_success.labels(source=name).set(health.last_success or 0)
            metrics.notice_source_failures.labels(source=name).set(health.consecutive_failures)
            out[name] = health.to_json()
        return out

    def slurm_lead(self) -> float:
        """Seconds before a Slurm job's end that its forced save starts: from the runs'
        measured save + upload times (the cadence advice), or ``[slurm] lead_seconds``."""
        advice = [
            state.advice or self.advisor.refresh(run) for run, state in self.advisor.runs.items()
        ]
        s = self.settings.slurm
        return lead_seconds(
            s.lead_seconds,
            s.lead_margin_seconds,
            max((a.save_seconds for a in advice), default=0.0),
            max((a.upload_seconds for a in advice), default=0.0),
        )

    async def run(self, fixed: list[NoticeSource]) -> None:
        """Every notice source, SIGTERM's included, into ``react``."""
        async with asyncio.TaskGroup() as group:
            for source in self.sources(fixed):
                group.create_task(self.follow(source), name=f"notices-{source.name}")

    async def follow(self, source: NoticeSource) -> None:
        """Feed one source's notices to ``react``; a source never ends the daemon."""
        while True:
            try:
                async for notice in source.watch():
                    await self.react(notice, source)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep listening whatever a source does
                self.log.error("notice_source_failed", source=source.name, error=repr(exc))
            await asyncio.sleep(self.settings.preemption.poll_interval_seconds)

    async def sigterm_is_a_notice(self) -> bool:
        """Whether this SIGTERM means the machine or pod is going away (flush first,
        exit last) rather than a stop or restart of ckptd alone (the trainer trains on,
        and nothing is written to its notice file)."""
        mode = self.settings.preemption.sigterm
        meaning = await asyncio.to_thread(sigterm_meaning, mode, os.environ)
        if meaning.notice:
            self.log.warning("sigterm_is_a_notice", why=meaning.why)
        else:
            self.log.info("sigterm_is_a_stop", why=meaning.why)
        return meaning.notice

    async def respond(self, notice: Notice, source: NoticeSource) -> Response | None:
        """Hand ``notice`` to the responder, by the many-node rules: another node's notice
        is skipped while this node already responds, and never published again."""
        followed = source is self.cluster_source
        current = self.responder.current
        if followed and current is not None:
            # Already signalled and in emergency mode (typically our own notice: a cloud
            # reclaims the whole cluster at once). Acting again would move the emergency
            # start past a checkpoint already saved for it, and take the response (and
            # its acknowledgement to our cloud) from our own notice.
            self.log.info(
                "cluster_notice_already_responding",
                source=notice.source,
                responding_to=current.notice.source,
            )
            return None
        # A notice followed from another node is never published again (no echo).
        response = await self.responder.handle(notice, source, publish=not followed)
        self.record(notice, response is not None)
        return response

    def record(self, notice: Notice, new: bool) -> None:
        """A new notice is an interruption of every run here; a drill is none."""
        if new and notice.kind != "drill":
            self.advisor.record_interruption("notice", notice.source)

    def end_followed_drill(
        self, notice: Notice, source: NoticeSource, response: Response | None
    ) -> None:
        """Another node's drill, or health save (``ckptd.daemon.health_loop``), responded
        to here: leave emergency mode as ``ckptd drill`` does on its own node (in the
        background; see ``_end_drill``)."""
        ends_by_itself = notice.kind in ("drill", "health-save")
        if source is self.cluster_source and ends_by_itself and response is not None:
            task = asyncio.create_task(self._end_drill(response))
            self._followed_drills.add(task)
            task.add_done_callback(self._followed_drills.discard)

    async def _end_drill(self, response: Response) -> None:
        """Leave emergency mode once our emergency checkpoint is committed or the drill's
        deadline passed."""
        left = response.notice.seconds_left(datetime.fromtimestamp(self.clock.time(), UTC))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(response.done.wait(), timeout=max(0.0, left or 0.0))
        if self.responder.current is response:
            self.responder.clear()


def remove_stale_notice_files(watch_dirs: list[Path], log: Any, keep: str | None = None) -> None:
    """A notice file left by an earlier daemon (a restart, a crash) describes a notice
    nobody acts on any more: it must not outlive it, unless it is the notice ``keep``
    names (one carried over, ``ckptd.notices.carried``: the trainer may be reading it)."""
    for watch_dir in watch_dirs:
        path = watch_dir / NOTICE_FILE
        if keep is not None and _notice_id(path) == keep:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.error("stale_notice_file_not_removed", path=str(path), error=str(exc))
            continue
        log.info("stale_notice_file_removed", path=str(path))


def _notice_id(path: Path) -> str | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    found = doc.get("id") if isinstance(doc, dict) else None
    return found if isinstance(found, str) else None
