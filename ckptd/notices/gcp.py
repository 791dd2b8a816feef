"""GCP: preemption (Spot and preemptible VMs) and host maintenance, via the metadata server.

What the Compute Engine metadata server does (and what this module relies on):

- Every request carries ``Metadata-Flavor: Google``; without it the server answers 403.
  Every genuine response carries ``Metadata-Flavor: Google`` too, which is how a client
  tells the metadata server from something else answering on that name (a proxy, a
  captive portal): a response without it is not believed.
  https://cloud.google.com/compute/docs/metadata/querying-metadata
  https://cloud.google.com/compute/docs/troubleshooting/troubleshoot-metadata-server
- Waiting for change: ``?wait_for_change=true`` makes a hanging GET that returns when the
  value changes; ``timeout_sec=N`` bounds the wait (the current value is returned at the
  end); each response has an ``ETag`` header, and ``last_etag=E`` returns at once if the
  value's ETag is no longer E, so no change is lost between two requests.
  https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange
- ``instance/preempted``: ``FALSE``, then ``TRUE`` once Compute Engine preempts the VM
  (Spot and preemptible VMs get about 30 s, the ACPI G2 soft-off notice).
  https://cloud.google.com/compute/docs/instances/create-use-preemptible#detecting_if_an_instance_was_preempted
  https://cloud.google.com/compute/docs/instances/spot#preemption-process
- ``instance/maintenance-event``: ``NONE``, then ``MIGRATE_ON_HOST_MAINTENANCE`` (about 60 s
  before a live migration) or ``TERMINATE_ON_HOST_MAINTENANCE`` (VMs that cannot migrate,
  e.g. with GPUs: 60 minutes before they are stopped), then ``NONE`` again. During
  maintenance the server may answer 503 for a short while: retry.
  https://cloud.google.com/compute/docs/metadata/getting-live-migration-notice
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

import aiohttp
import structlog

from ckptd.notices.client import BadResponse, MetadataSource, describe_error, session_scope
from ckptd.notices.model import Clock, Notice, Sleep, utc_now

INSTANCE_PATH = "/computeMetadata/v1/instance/"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR_VALUE = "Google"

#: maintenance-event value -> how long before the VM is affected (documented notice).
MAINTENANCE_NOTICE: dict[str, timedelta] = {
    "MIGRATE_ON_HOST_MAINTENANCE": timedelta(seconds=60),
    "TERMINATE_ON_HOST_MAINTENANCE": timedelta(minutes=60),
}

log = structlog.get_logger("ckptd.notices.gcp")


@dataclass
class _Response:
    status: int
    text: str
    headers: Mapping[str, str]


class GcpMetadataSource(MetadataSource):
    """Hanging GETs on ``instance/preempted`` and ``instance/maintenance-event``."""

    name = "gcp"

    def __init__(
        self,
        endpoint: str = "http://metadata.google.internal",
        retry_interval: float = 1.0,
        *,
        hang_timeout: int = 60,
        request_timeout: float = 10.0,
        max_backoff: float = 5.0,
        preemption_notice: float = 30.0,
        session: aiohttp.ClientSession | None = None,
        clock: Clock = utc_now,
        sleep: Sleep = asyncio.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        log_interval: float = 60.0,
    ) -> None:
        super().__init__(
            endpoint,
            session=session,
            clock=clock,
            sleep=sleep,
            monotonic=monotonic,
            log=log,
            log_interval=log_interval,
        )
        self.retry_interval = retry_interval
        self.hang_timeout = max(1, int(hang_timeout))
        self.request_timeout = request_timeout
        self.max_backoff = max(max_backoff, retry_interval)
        self.preemption_notice = timedelta(seconds=preemption_notice)
        self._preempted = False
        self._maintenance: str | None = None
        self._maintenance_events = 0  # maintenance events seen, for their ids

    async def acknowledge(self, notice: Notice) -> None:
        """GCP has nothing to acknowledge."""

    async def watch(self) -> AsyncIterator[Notice]:
        """Watch both keys concurrently; yield each new notice once."""
        queue: asyncio.Queue[Notice] = asyncio.Queue()
        async with session_scope(self._session) as session:
            tasks = [
                asyncio.create_task(
                    self._watch_key(session, "preempted", self._on_preempted, queue),
                    name="ckptd-gcp-preempted",
                ),
                asyncio.create_task(
                    self._watch_key(session, "maintenance-event", self._on_maintenance, queue),
                    name="ckptd-gcp-maintenance-event",
                ),
            ]
            try:
                while True:
                    yield await queue.get()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    # -- value handling (pure state machines) --------------------------------------------

    def _on_preempted(self, value: str, etag: str | None, now: datetime) -> Notice | None:
        if value == "FALSE":
            self._preempted = False
            return None
        if value != "TRUE":
            raise BadResponse(f"preempted is {value[:40]!r}, not TRUE or FALSE")
        if self._preempted:
            return None
        self._preempted = True
        return Notice(
            source="gcp",
            kind="preemption",
            id="preempted",  # preemption happens once in a VM's life
            noticed_at=now,
            deadline=now + self.preemption_notice,
            detail={"key": "instance/preempted", "value": value, "etag": etag},
        )

    def _on_maintenance(self, value: str, etag: str | None, now: datetime) -> Notice | None:
        if value == "NONE":
            # The event is over; a later one is a new notice.
            self._maintenance = None
            return None
        if value not in MAINTENANCE_NOTICE:
            raise BadResponse(f"maintenance-event is {value[:40]!r}")
        if value == self._maintenance:
            return None
        self._maintenance = value
        self._maintenance_events += 1
        return Notice(
            source="gcp",
            kind="maintenance",
            # GCP gives maintenance no id: the state names it, and a count tells one
            # event (NONE -> state -> NONE) from the next. Never the time it was seen.
            id=f"maintenance:{value}:{self._maintenance_events}",
            noticed_at=now,
            deadline=now + MAINTENANCE_NOTICE[value],
            detail={"key": "instance/maintenance-event", "value": value, "etag": etag},
        )

    # -- the hanging-GET loop ------------------------------------------------------------

    async def _watch_key(
        self,
        session: aiohttp.ClientSession,
        key: str,
        on_value: Callable[[str, str | None, datetime], Notice | None],
        queue: asyncio.Queue[Notice],
    ) -> None:
        # First a plain GET (the current value and its ETag), then hanging GETs with
        # last_etag, so a change between two requests is never missed.
        etag: str | None = None
        waiting = False
        backoff = self.retry_interval
        while True:
            started = self._monotonic()
            answered = False  # a genuine 200 from the metadata server, whatever its value
            new_etag: str | None = None
            try:
                resp = await self._get(session, key, waiting, etag)
                if resp.status == 503:
                    # Documented as transient during maintenance: retry soon, no backoff.
                    self._warn.warning(key, "metadata server busy (503), retrying")
                    await self._sleep(self.retry_interval)
                    continue
                if resp.status != 200:
                    raise BadResponse(f"HTTP {resp.status}")
                if resp.headers.get(FLAVOR_HEADER) != FLAVOR_VALUE:
                    raise BadResponse(f"response lacks {FLAVOR_HEADER}: {FLAVOR_VALUE}")
                answered, new_etag = True, resp.headers.get("ETag")
                notice = on_value(resp.text.strip(), new_etag, self._clock())
            except (aiohttp.ClientError, TimeoutError, BadResponse) as exc:
                self._warn.warning(
                    key, "metadata read failed", url=self._url(key), error=describe_error(exc)
                )
                if answered:
                    # An unexpected value: wait for it to change (a hanging GET on its
                    # ETag) rather than back off, so a real change is seen at once; pause
                    # only if the server answered at once (it should have hung).
                    etag, waiting = new_etag, True
                    if self._monotonic() - started < self.hang_timeout / 2:
                        await self._sleep(self.retry_interval)
                    continue
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the watch
                self._warn.warning(
                    key,
                    "metadata watch failed unexpectedly",
                    error=describe_error(exc),
                    exc_info=True,
                )
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            self._warn.recovered(key, "metadata read works again", url=self._url(key))
            backoff = self.retry_interval
            if notice is not None:
                await queue.put(notice)
            unchanged = waiting and new_etag is not None and new_etag == etag
            etag, waiting = new_etag, True
            # A server that answers a hanging GET at once without a change would make this
            # loop spin; pause instead (a real timeout returns after hang_timeout).
            if unchanged and self._monotonic() - started < self.hang_timeout / 2:
                await self._sleep(self.retry_interval)

    async def _get(
        self, session: aiohttp.ClientSession, key: str, waiting: bool, etag: str | None
    ) -> _Response:
        params: dict[str, str] = {}
        if waiting:
            params["wait_for_change"] = "true"
            params["timeout_sec"] = str(self.hang_timeout)
            if etag is not None:
                params["last_etag"] = etag
        # The client-side timeout must outlast the server-side hang.
        timeout = self.request_timeout + (self.hang_timeout if waiting else 0)
        async with session.get(
            self._url(key),
            params=params,
            headers={FLAVOR_HEADER: FLAVOR_VALUE},
            timeout=aiohttp.ClientTimeout(total=timeout),
            allow_redirects=False,
        ) as resp:
            text = await resp.text(errors="replace")
            return _Response(resp.status, text, resp.headers.copy())  # case-insensitive

    def _url(self, key: str) -> str:
        return self.endpoint + INSTANCE_PATH + key
