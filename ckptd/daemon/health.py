"""Whether the destination works, as the daemon last found it.

``DestinationHealth.check`` asks the store (``RetryingStorage.probe``: a few quick
attempts, never an operation's long retries) and keeps the answer for
``/readyz``, ``/v1/status``, ``ckptd_destination_up``, ``ckptd_tier_up`` and the SIGTERM
flush (which does not wait on a destination that refuses it). The first failure, and the
recovery, are logged once each, not at every check.

Invariant: the answer is never older than the last request that failed. Every request a
tier's pipeline makes goes through ``WatchedStorage`` (early shipping's, a claim's, a
part's, a manifest's), and each failed attempt of it, retried or final, makes the
destination ``suspected``: the rechecks (``ckptd.daemon.tier_set``) ask the store at their
next round, within a second, instead of up to ``RECHECK_OK_SECONDS`` later. A probe of a
destination that is down fails within a second or two, so ``ckptd_tier_up`` drops within
seconds of the first failing write; where the probe still succeeds (a failure of one
object, not of the destination) the tier stays up. The probe decides, never one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ckptd.runtime.metrics import Metrics
from ckptd.storage.base import (
    VERIFY_CODES,
    NotFoundError,
    PreconditionFailedError,
    ShortObjectError,
    Storage,
    StorageError,
)
from ckptd.storage.retrying import RetryingStorage
from ckptd.storage.wrapper import StorageWrapper

T = TypeVar("T")

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
        # A request failed since the last check (module doc): set from any thread.
        self.suspected = threading.Event()

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

    def suspect(self, exc: StorageError) -> None:
        """A request to this destination failed (any thread): check it at the next round
        of rechecks, unless the failure is one object's, not the destination's."""
        if not against_destination(exc) or self.suspected.is_set():
            return
        self.suspected.set()
        if self.ok:
            # Said once per suspicion; the check that follows says whether it is down.
            with contextlib.suppress(Exception):  # a logger never fails a request
                self.log.warning(
                    "destination_request_failed",
                    destination=self.storage.url,
                    tier=self.tier,
                    error=str(exc),
                    code=exc.code,
                    action="checking the destination now",
                )

    def retry_seen(self, operation: str, exc: StorageError, attempt: int, delay: float) -> None:
        """``RetryingStorage.on_retry``'s share for health: a retried attempt of any
        request but the probe's own makes the destination suspected."""
        if operation != "check":
            self.suspect(exc)

    async def check(self) -> bool:
        """Ask the store now; returns whether it is usable."""
        self.suspected.clear()  # a request failing from here on asks for another check
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


def against_destination(exc: StorageError) -> bool:
    """Whether a failed request says something of the destination rather than of one
    object: a key that is not there, a conditional write that lost, an object shorter
    than asked or bytes that do not verify are answers of a store that works."""
    if isinstance(exc, NotFoundError | PreconditionFailedError | ShortObjectError):
        return False
    return exc.code not in VERIFY_CODES


class WatchedStorage(StorageWrapper):
    """The storage a tier's pipeline works through: a request that fails after its
    retries makes ``on_failure`` hear of it (``DestinationHealth.suspect``), then
    raises as before. Its retried attempts are heard through ``retry_seen``."""

    def __init__(self, inner: Storage, on_failure: Callable[[StorageError], None]) -> None:
        super().__init__(inner)
        self.on_failure = on_failure

    def _run(self, operation: str, fn: Callable[[], T], *, sends: int | None = None) -> T:
        try:
            return fn()
        except StorageError as exc:
            self.on_failure(exc)
            raise
