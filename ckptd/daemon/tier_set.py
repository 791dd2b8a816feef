"""The tier set: every destination this daemon ships to, each with its own pipeline,
journal and health, the first one (``[destination]``) first.

A tier that is down holds no other back: each has its own worker and its own store
checks. Local retention deletes only what every tier has committed, and a file event or
a rescan goes to every tier. The tiers are opened in ``ckptd.daemon.build``; this class
is what the daemon does with them once they run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ckptd.config import DestinationConfig, RetentionConfig, Settings, TierConfig
from ckptd.daemon.health import RECHECK_FAILING_SECONDS, DestinationHealth
from ckptd.runtime.clock import Clock
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline

# The per-run figures a tier shows under ``status()["tiers"]``.
TIER_RUN_FIELDS = (
    "pending",
    "uploading",
    "last_committed",
    "failed",
    "failures",
    "sync_lag_seconds",
)


@dataclass
class Tier:
    """One destination with its own pipeline, journal and health (docs: "Tiers")."""

    name: str
    journal: Journal
    health: DestinationHealth
    pipeline: SyncPipeline
    last_check: float = 0.0


def tier_settings(settings: Settings, tier: TierConfig) -> Settings:
    """The settings a further tier's pipeline runs with: its destination and retention,
    the node's local retention, no early shipping (first tier only), one node."""
    destination = DestinationConfig(**tier.model_dump(exclude={"retention"}))
    retention = RetentionConfig(
        **tier.retention.model_dump(), local_keep_last=settings.retention.local_keep_last
    )
    watch = [w.model_copy(update={"ship_early": False}) for w in settings.watch]
    return settings.model_copy(
        update={"destination": destination, "retention": retention, "watch": watch}
    )


def committed_in_every_tier(pipelines: Sequence[SyncPipeline], run: str) -> set[str]:
    """Local retention deletes only what every tier has committed."""
    sets = [p.runs[run].committed for p in pipelines]
    return set.intersection(*(set(c) for c in sets))


class TierSet:
    """The tiers in order; iterating gives each ``Tier``, the first one first."""

    def __init__(self, tiers: list[Tier], clock: Clock) -> None:
        self._tiers = tiers
        self.clock = clock

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    @property
    def first(self) -> Tier:
        return self._tiers[0]

    @property
    def further(self) -> list[Tier]:
        """Every tier but the first (``[[tiers]]``, in order)."""
        return self._tiers[1:]

    def committed_in_every_tier(self, run: str) -> set[str]:
        return committed_in_every_tier([t.pipeline for t in self._tiers], run)

    def hint(self, run_id: str, name: str | None, delay: float | None = None) -> None:
        """A file event, to every tier's pipeline."""
        for t in self._tiers:
            if delay is None:
                t.pipeline.hint(run_id, name)
            else:
                t.pipeline.hint(run_id, name, delay)

    def record_seen(self, run_id: str, name: str | None) -> None:
        """A commit record appeared, to every tier's pipeline (looked at now)."""
        for t in self._tiers:
            t.pipeline.record_seen(run_id, name)

    async def rescan(self, run_id: str, *, committed: bool = False) -> None:
        """Look at every checkpoint of ``run_id`` again, for every tier (``committed``:
        the names committed already too, ``SyncPipeline.rescan``)."""
        for t in self._tiers:
            await t.pipeline.rescan(run_id, committed=committed)

    async def drain_once(self) -> bool:
        """Every tier ships what is queued now (``run --once``); False if any failed."""
        ok = True
        for t in self._tiers:
            ok = await t.pipeline.drain_once() and ok
        return ok

    async def retain(self) -> None:
        """A retention pass of every run on every tier, each by its own policy, the tiers
        side by side; a tier whose pass fails is said and the others go on."""

        async def one(t: Tier) -> None:
            try:
                await t.pipeline.retain()
            except Exception as exc:  # noqa: BLE001 - a stop goes on whatever a pass met
                t.pipeline.log.warning("retention_at_stop_failed", tier=t.name, error=str(exc))

        await asyncio.gather(*(one(t) for t in self._tiers))

    def busy(self) -> bool:
        """Some tier still has work ``run --once`` waits for. A further tier that refuses
        this node (credentials, bucket) is not waited for: it holds the others back no
        more here than in the daemon (the exit is 1)."""
        first = self.first.pipeline
        return any(
            not t.pipeline.idle() and (t.pipeline is first or t.pipeline.unusable is None)
            for t in self._tiers
        )

    def refused(self) -> list[str]:
        """The tiers whose store refused this node, by name."""
        return [t.name for t in self._tiers if t.pipeline.unusable is not None]

    async def recheck_stores(self, interval: float) -> None:
        """Each tier's store asked again when due, every ``interval``: a probe of a store
        that is down waits for its connection timeout, which must never hold the ticker
        (systemd's watchdog) nor the rescans, so this runs beside them; and the tiers are
        asked side by side, so one that is down delays no other's answer."""
        for t in self._tiers:
            t.last_check = self.clock.monotonic()  # start-up has just asked
        while True:
            await asyncio.sleep(interval)
            now = self.clock.monotonic()
            await asyncio.gather(*(self.check(t, now) for t in self._tiers))

    async def check(self, tier: Tier, now: float) -> None:
        """Ask a tier's store again when due; when it comes back, its backlog is shipped
        at once rather than after the rest of its backoff."""
        # A request that failed (``DestinationHealth.suspect``: early shipping's, a
        # claim's, any) makes a tier that is up due now, and a checkpoint that failed in
        # it makes it due soon: the metrics say the tier is down within seconds, and its
        # return is noticed as soon.
        suspected = tier.health.ok and tier.health.suspected.is_set()
        failing = any(p.failures for p in tier.pipeline.queue)
        interval = RECHECK_FAILING_SECONDS if failing else tier.health.recheck_seconds
        if not suspected and now - tier.last_check < interval:
            return
        tier.last_check = now
        was_ok = tier.health.ok
        if await tier.health.check() and not was_ok:
            tier.pipeline.retry_now()

    def status(self, first_runs: dict[str, Any]) -> dict[str, Any]:
        """``status()["tiers"]``: each tier's destination and per-run figures;
        ``first_runs`` is the first pipeline's ``status()["runs"]``, already taken."""
        return {
            t.name: {
                "destination": t.health.to_json(),
                "runs": {
                    run: {field: entry[field] for field in TIER_RUN_FIELDS}
                    for run, entry in (
                        first_runs if t is self.first else t.pipeline.status()["runs"]
                    ).items()
                },
            }
            for t in self._tiers
        }

    async def close(self) -> None:
        """Every pipeline closed, then its store's connections, then its journal."""
        for t in self._tiers:
            await t.pipeline.close()
            await asyncio.to_thread(close_connections, t.health.storage)
            t.journal.close()


def close_connections(storage: Any) -> None:
    """Close the connections the backend under ``storage``'s wrappers keeps open, where
    it has a ``close`` (S3's direct path); the others keep none between requests."""
    while hasattr(storage, "inner"):
        storage = storage.inner
    close = getattr(storage, "close", None)
    if callable(close):
        close()
