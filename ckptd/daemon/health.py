"""Whether the destination works, as the daemon last found it.

``DestinationHealth.check`` asks the store (``RetryingStorage.probe``: a few quick
attempts, never an operation's long retries) and keeps the answer for
``/readyz``, ``/v1/status``, ``ckptd_destination_up`` and the SIGTERM flush (which does
not wait on a destination that refuses it). The first failure, and the recovery, are
logged once each, not at every check.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import StorageError
from ckptd.storage.retrying import RetryingStorage

# How often to ask again: soon while it fails (to notice the recovery), rarely when fine.
RECHECK_FAILING_SECONDS = 5.0
RECHECK_OK_SECONDS = 60.0


class DestinationHealth:
    """The destination's last known state."""

    def __init__(
        self,
        storage: RetryingStorage,
        metrics: Metrics,
        log: Any,
        *,
        tier: str = "primary",
        tier_metrics: Metrics | None = None,
    ) -> None:
        self.storage = storage
        self.metrics = metrics
        self.log = log
        self.tier = tier
        self.tier_metrics = tier_metrics if tier_metrics is not None else metrics
        self.ok = False
        self.error = ""
        self.failure: StorageError | None = None  # the last check's, while failing

    @property
    def refusal(self) -> StorageError | None:
        """The last check's error when the destination as configured can never work
        (credentials, no bucket): waiting for it helps no one. ``None`` while it works or
        is merely unreachable, which may pass."""
        failure = self.failure
        return failure if failure is not None and failure.destination_unusable else None

    @property
    def recheck_seconds(self) -> float:
        return RECHECK_OK_SECONDS if self.ok else RECHECK_FAILING_SECONDS

    async def check(self) -> bool:
        """Ask the store now; returns whether it is usable."""
        try:
            await asyncio.to_thread(self.storage.probe)
        except StorageError as exc:
            if self.ok or not self.error:
                self.log.error(
                    "destination_unusable",
                    destination=self.storage.url,
                    tier=self.tier,
                    error=str(exc),
                    code=exc.code,
                )
            self.ok = False
            self.error = str(exc)
            self.failure = exc
            self.metrics.destination_up.set(0)
            self.tier_metrics.tier_up.labels(tier=self.tier).set(0)
            return False
        if not self.ok:
            self.log.info("destination_ok", destination=self.storage.url, tier=self.tier)
        self.ok = True
        self.error = ""
        self.failure = None
        self.metrics.destination_up.set(1)
        self.tier_metrics.tier_up.labels(tier=self.tier).set(1)
        return True

    def to_json(self) -> dict[str, Any]:
        """``/v1/status``'s ``destination``: its URL, whether it works, and if not why
        (the last check's error, as ``/readyz`` and the log have it; "" while it works)."""
        return {"url": self.storage.url, "ok": self.ok, "tier": self.tier, "error": self.error}
