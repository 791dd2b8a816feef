"""One node's notice, every node's notice: the run's ``NOTICE`` object in the store.

With ``cluster.nodes > 1`` the ranks of one job save together (a DCP or ZeRO save is a
collective): a notice that reaches one node must make every node's trainer save, or the
save never meets. No daemon talks to another; the store carries it (docs/design.md, "Many
nodes, one checkpoint"):

    publish  a notice of this node's own (cloud, SIGTERM, ``ckptd drill``) is written to
             ``<run>/NOTICE`` for each watched run, in the background, after the trainer's
             signal is under way; a failed write is logged, counted and retried every
             poll interval until written or the notice's deadline passes; never fatal
    follow   every node polls each run's NOTICE every ``cluster.poll_interval_seconds``;
             another node's notice, noticed after this daemon started and with a deadline
             not yet past, becomes a Notice from ``node-<k>/<its source>``, once, and the
             responder acts on it exactly as on a notice of our own

A followed notice is never published again (the service hands the publisher only its
own notices), so two nodes cannot echo one notice back and forth; a NOTICE this node
wrote itself is never followed. A NOTICE from before this daemon started belongs to an
earlier incarnation of the cluster (the one that was preempted) and is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import structlog

from ckptd.notices.model import (
    Clock,
    Notice,
    RateLimitedLog,
    Sleep,
    format_time,
    parse_time,
    utc_now,
)
from ckptd.repository import Repository
from ckptd.runtime.metrics import Metrics

log = structlog.get_logger("ckptd.notices.cluster")

SOURCE_NAME = "cluster"
# With no deadline to bound it (a rebalance recommendation), publishing is retried this
# long at most.
UNBOUNDED_RETRY_SECONDS = 120.0


def notice_document(notice: Notice, *, node_rank: int, host: str) -> dict[str, Any]:
    """The NOTICE body for ``notice`` seen on node ``node_rank`` (``format`` is added by
    the repository)."""
    return {
        "source": notice.source,
        "kind": notice.kind,
        "deadline": format_time(notice.deadline) if notice.deadline is not None else None,
        "noticed_at": format_time(notice.noticed_at),
        "node_rank": node_rank,
        "host": host,
        "id": notice.id,
    }


@dataclass(frozen=True)
class Judgement:
    """What to do with one NOTICE: ``notice`` to act on, or None and ``reason`` why not."""

    notice: Notice | None
    reason: str


def judge_notice(
    doc: Mapping[str, Any], *, own_rank: int, started_at: datetime, now: datetime
) -> Judgement:
    """Whether a NOTICE document is one to follow; pure (time comes in as arguments)."""
    try:
        rank = doc["node_rank"]
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            return Judgement(None, "malformed: node_rank")
        origin = str(doc["source"])
        kind = str(doc["kind"])
        noticed_at = parse_time(str(doc["noticed_at"]))
        raw_deadline = doc.get("deadline")
        deadline = parse_time(str(raw_deadline)) if raw_deadline else None
    except (KeyError, ValueError, TypeError):
        return Judgement(None, "malformed")
    # Stale first: an earlier cluster's NOTICE is stale whoever wrote it (and is logged so).
    # A NOTICE's times have millisecond precision: compare the start time at that precision.
    if noticed_at <= started_at.replace(microsecond=started_at.microsecond // 1000 * 1000):
        return Judgement(None, "stale: noticed before this daemon started")
    if deadline is not None and deadline <= now:
        return Judgement(None, "stale: deadline past")
    if rank == own_rank:
        return Judgement(None, "own")
    origin_id = str(doc.get("id") or f"{origin}:{kind}:{format_time(noticed_at)}")
    notice = Notice(
        source=f"node-{rank}/{origin}",
        kind=kind,
        id=f"node-{rank}/{origin_id}",
        noticed_at=noticed_at,
        deadline=deadline,
        detail={"node_rank": rank, "host": str(doc.get("host", "")), "origin": origin},
    )
    return Judgement(notice, "follow")


class ClusterNoticeSource:
    """Follows other nodes' notices through each run's ``NOTICE`` (module doc, "follow").

    A NoticeSource: ``watch()`` yields each followed notice once, logs store errors
    (rate-limited) and keeps polling. What it has yielded or ignored is kept on the
    instance, so a restarted ``watch()`` does not yield the same notice again.
    """

    name = SOURCE_NAME

    def __init__(
        self,
        repo: Repository,
        runs: list[str],
        *,
        own_rank: int,
        started_at: datetime,
        interval: float,
        metrics: Metrics | None = None,
        clock: Clock = utc_now,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.repo = repo
        self.runs = list(runs)
        self.own_rank = own_rank
        self.started_at = started_at
        self.interval = interval
        self.metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._seen: set[str] = set()  # notice ids yielded
        self._ignored: set[tuple[str, str]] = set()  # (run, NOTICE noticed_at) logged once
        self._errors = RateLimitedLog(log)

    async def acknowledge(self, notice: Notice) -> None:
        """Nothing to acknowledge: the node that saw the notice acknowledges its cloud."""

    async def poll_once(self) -> list[Notice]:
        """Read every run's NOTICE once; the notices to act on (new ones only)."""
        found: list[Notice] = []
        for run in self.runs:
            try:
                doc = await asyncio.to_thread(self.repo.read_notice, run)
            except Exception as exc:  # noqa: BLE001 - a store outage must not end the poller
                self._errors.warning(run, "cluster_notice_read_failed", run=run, error=str(exc))
                continue
            self._errors.recovered(run, "cluster_notice_read_recovered", run=run)
            if doc is None:
                continue
            judged = judge_notice(
                doc, own_rank=self.own_rank, started_at=self.started_at, now=self._clock()
            )
            if judged.notice is None:
                key = (run, str(doc.get("noticed_at")))
                if judged.reason != "own" and key not in self._ignored:
                    self._ignored.add(key)
                    log.info(
                        "cluster_notice_ignored",
                        run=run,
                        reason=judged.reason,
                        node_rank=doc.get("node_rank"),
                        noticed_at=doc.get("noticed_at"),
                    )
                continue
            if judged.notice.id in self._seen:
                continue
            self._seen.add(judged.notice.id)
            if self.metrics is not None:
                self.metrics.cluster_notices.labels(run=run, event="followed").inc()
            found.append(judged.notice)
        return found

    async def watch(self) -> AsyncIterator[Notice]:
        """Yield other nodes' notices as they appear, until cancelled."""
        while True:
            for notice in await self.poll_once():
                yield notice
            await self._sleep(self.interval)


class NoticePublisher:
    """Writes this node's own notices to each run's ``NOTICE`` (module doc, "publish")."""

    def __init__(
        self,
        repo: Repository,
        runs: list[str],
        *,
        node_rank: int,
        host: str,
        retry_seconds: float,
        metrics: Metrics | None = None,
        clock: Clock = utc_now,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.repo = repo
        self.runs = list(runs)
        self.node_rank = node_rank
        self.host = host
        self.retry_seconds = retry_seconds
        self.metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._tasks: set[asyncio.Task[bool]] = set()

    def publish(self, notice: Notice) -> asyncio.Task[bool]:
        """Start writing ``notice`` in the background; the task says whether every run's
        NOTICE was written. Returns at once (it only schedules)."""
        task = asyncio.get_running_loop().create_task(
            self._publish(notice), name=f"publish-{notice.id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _publish(self, notice: Notice) -> bool:
        doc = notice_document(notice, node_rank=self.node_rank, host=self.host)
        now = self._clock()
        give_up = notice.deadline or now + timedelta(seconds=UNBOUNDED_RETRY_SECONDS)
        left = list(self.runs)
        attempt = 0
        while left:
            attempt += 1
            for run in list(left):
                try:
                    await asyncio.to_thread(self.repo.write_notice, run, doc)
                except Exception as exc:  # noqa: BLE001 - best effort, retried, never fatal
                    self._count(run, "publish_failed")
                    log.error(
                        "cluster_notice_publish_failed",
                        run=run,
                        attempt=attempt,
                        error=str(exc),
                    )
                    continue
                left.remove(run)
                self._count(run, "published")
                log.warning(
                    "cluster_notice_published",
                    run=run,
                    source=notice.source,
                    kind=notice.kind,
                    node_rank=self.node_rank,
                )
            if left:
                if self._clock() >= give_up:
                    log.error("cluster_notice_not_published", runs=left, attempts=attempt)
                    return False
                await self._sleep(self.retry_seconds)
        return True

    def _count(self, run: str, event: str) -> None:
        if self.metrics is not None:
            self.metrics.cluster_notices.labels(run=run, event=event).inc()

    async def drain(self, timeout: float) -> None:
        """Give writes in flight up to ``timeout`` seconds (before the store is closed),
        then cancel what is left."""
        pending = set(self._tasks)
        if not pending:
            return
        _done, still = await asyncio.wait(pending, timeout=timeout)
        for task in still:
            task.cancel()
        for task in still:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
