"""Azure: Scheduled Events (Spot eviction, terminate, reboot, redeploy, freeze) via IMDS.

What the Azure Instance Metadata Service does (and what this module relies on):

- Every request carries ``Metadata: true`` and no ``X-Forwarded-For``, or IMDS answers
  400 Bad Request; an ``api-version`` is mandatory. IMDS must never be reached through a
  proxy (aiohttp ignores proxy variables unless ``trust_env=True``). 410 and 500 mean
  retry; 429 means more than 5 requests per second.
  https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service#errors-and-debugging
- ``GET /metadata/scheduledevents?api-version=2020-07-01`` returns
  ``{"DocumentIncarnation": 2, "Events": [{"EventId": "C7061BAC-...", "EventStatus":
  "Scheduled" | "Started", "EventType": "Freeze" | "Reboot" | "Redeploy" | "Preempt" |
  "Terminate", "ResourceType": "VirtualMachine", "Resources": ["WestNO_0", "WestNO_1"],
  "NotBefore": "Mon, 11 Apr 2026 22:26:58 GMT" (empty once started), "Description",
  "EventSource": "Platform" | "User", "DurationInSeconds": 5}]}``. Events for a whole
  availability set or placement group reach every VM in it: ``Resources`` says which VMs
  are affected. An event leaves the list when it completes, or when Azure cancels it
  before it starts. Preempt gives at least 30 s. The first call enables the service and
  may take up to two minutes; 24 hours without a call disables it again, so keep polling.
  https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events
- Acknowledge (let the event start early) with a POST of
  ``{"StartRequests": [{"EventId": "..."}]}`` to the same URL: 200 for a valid EventId,
  400 for a malformed request.
  https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#start-an-event
- This VM's name, to match against ``Resources``:
  ``GET /metadata/instance/compute/name?api-version=2021-02-01&format=text`` (a leaf
  node, so ``format=text`` is required).
  https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service#instance-metadata
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import structlog

from ckptd.notices.client import BadResponse, MetadataSource, describe_error, session_scope
from ckptd.notices.model import Clock, Notice, Sleep, utc_now

SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
SCHEDULED_EVENTS_API_VERSION = "2020-07-01"
COMPUTE_NAME_PATH = "/metadata/instance/compute/name"
COMPUTE_API_VERSION = "2021-02-01"
METADATA_HEADERS: Mapping[str, str] = {"Metadata": "true"}

#: EventType -> Notice.kind; other types (should Azure add any) are ignored.
EVENT_KINDS: dict[str, str] = {
    "Preempt": "preemption",
    "Terminate": "terminate",
    "Reboot": "reboot",
    "Redeploy": "redeploy",
    "Freeze": "freeze",
}

log = structlog.get_logger("ckptd.notices.azure")


class AzureScheduledEventsSource(MetadataSource):
    """Polls Scheduled Events; yields new events for this VM, and their cancellation."""

    name = "azure"

    def __init__(
        self,
        endpoint: str = "http://169.254.169.254",
        vm_name: str | None = None,
        poll_interval: float = 1.0,
        *,
        request_timeout: float = 5.0,
        first_request_timeout: float = 180.0,
        name_retry_interval: float = 30.0,
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
        self.vm_name = vm_name
        self.poll_interval = poll_interval
        self.request_timeout = request_timeout
        self.first_request_timeout = first_request_timeout
        self.name_retry_interval = name_retry_interval
        self._active_session: aiohttp.ClientSession | None = None
        self._answered_once = False
        self._next_name_lookup = 0.0
        self._known: dict[str, Notice] = {}
        self.incarnation: int | None = None

    @property
    def url(self) -> str:
        """The Scheduled Events URL (GET to read, POST to acknowledge)."""
        return f"{self.endpoint}{SCHEDULED_EVENTS_PATH}?api-version={SCHEDULED_EVENTS_API_VERSION}"

    async def watch(self) -> AsyncIterator[Notice]:
        """Poll every ``poll_interval`` seconds; yield new and cancelled events once."""
        async with session_scope(self._session) as session:
            self._active_session = session
            try:
                while True:
                    try:
                        notices = await self.poll_once(session)
                    except Exception as exc:  # noqa: BLE001 - a bug must not end the watch
                        self._warn.warning(
                            "poll",
                            "imds poll failed unexpectedly",
                            error=describe_error(exc),
                            exc_info=True,
                        )
                        notices = []
                    for notice in notices:
                        yield notice
                    await self._sleep(self.poll_interval)
            finally:
                self._active_session = None

    async def poll_once(self, session: aiohttp.ClientSession) -> list[Notice]:
        """One read of the document; returns new and cancelled notices, and known ones
        whose NotBefore moved (the same EventId: an update of its deadline)."""
        if self.vm_name is None and self._monotonic() >= self._next_name_lookup:
            await self._lookup_vm_name(session)
        document = await self._read_document(session)
        if document is None:
            return []
        return self._diff(document, self._clock())

    async def acknowledge(self, notice: Notice) -> None:
        """POST StartRequests for ``notice.id`` so the event may start now (3 tries)."""
        if notice.source != "azure" or notice.cancelled:
            return
        body = json.dumps({"StartRequests": [{"EventId": notice.id}]})
        async with self._ack_session() as session:
            for attempt in range(3):
                try:
                    async with session.post(
                        self.url,
                        data=body,
                        headers={**METADATA_HEADERS, "Content-Type": "application/json"},
                        timeout=aiohttp.ClientTimeout(total=self.request_timeout),
                        allow_redirects=False,
                    ) as resp:
                        await resp.read()
                        if resp.status == 200:
                            log.info("scheduled event acknowledged", event_id=notice.id)
                            return
                        error = f"HTTP {resp.status}"
                        if resp.status == 400:
                            # Malformed request or unknown EventId: retrying will not help.
                            log.warning("acknowledge rejected", event_id=notice.id, error=error)
                            return
                except (aiohttp.ClientError, TimeoutError) as exc:
                    error = describe_error(exc)
                log.warning("acknowledge failed", event_id=notice.id, error=error, attempt=attempt)
                if attempt < 2:
                    await self._sleep(0.5 * (attempt + 1))

    # -- I/O ---------------------------------------------------------------------------

    async def _lookup_vm_name(self, session: aiohttp.ClientSession) -> None:
        url = f"{self.endpoint}{COMPUTE_NAME_PATH}"
        params = {"api-version": COMPUTE_API_VERSION, "format": "text"}
        try:
            async with session.get(
                url,
                params=params,
                headers=METADATA_HEADERS,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
                allow_redirects=False,
            ) as resp:
                text = (await resp.text(errors="replace")).strip()
                if resp.status != 200:
                    raise BadResponse(f"HTTP {resp.status}")
                if not text or len(text) > 128 or any(c.isspace() for c in text):
                    raise BadResponse("compute/name is not a VM name")
        except (aiohttp.ClientError, TimeoutError, BadResponse) as exc:
            # Unknown name: every event is taken as ours (a needless checkpoint is cheap,
            # a missed eviction is not). Try again later.
            self._next_name_lookup = self._monotonic() + self.name_retry_interval
            self._warn.warning(
                "compute-name",
                "vm name unknown; taking every event as ours",
                error=describe_error(exc),
            )
            return
        self.vm_name = text
        log.info("vm name from imds", vm_name=text)

    async def _read_document(self, session: aiohttp.ClientSession) -> dict[str, Any] | None:
        # The first call can take up to two minutes (it enables the service).
        timeout = self.request_timeout if self._answered_once else self.first_request_timeout
        try:
            async with session.get(
                self.url,
                headers=METADATA_HEADERS,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
            ) as resp:
                text = await resp.text(errors="replace")
                if resp.status != 200:
                    raise BadResponse(f"HTTP {resp.status}")
            document = json.loads(text)
            _validate(document)
        except (aiohttp.ClientError, TimeoutError, BadResponse, ValueError) as exc:
            self._warn.warning(
                "scheduledevents", "imds read failed", url=self.url, error=describe_error(exc)
            )
            return None
        self._answered_once = True
        self._warn.recovered("scheduledevents", "imds read works again", url=self.url)
        return document  # type: ignore[no-any-return]

    # -- the document diff (pure) ------------------------------------------------------

    def _is_ours(self, event: Mapping[str, Any]) -> bool:
        if self.vm_name is None:
            return True
        resources = event.get("Resources")
        if not isinstance(resources, list):
            return True  # no list to go by: err on the side of a checkpoint
        name = self.vm_name.casefold()  # Azure resource names are case-insensitive
        return any(isinstance(r, str) and r.casefold() == name for r in resources)

    def _diff(self, document: Mapping[str, Any], now: datetime) -> list[Notice]:
        incarnation = document.get("DocumentIncarnation")
        self.incarnation = incarnation if isinstance(incarnation, int) else None
        current: dict[str, Mapping[str, Any]] = {}
        for event in document["Events"]:
            if event["EventType"] in EVENT_KINDS and self._is_ours(event):
                current[event["EventId"]] = event
        notices: list[Notice] = []
        for event_id, event in current.items():
            deadline = _parse_not_before(event.get("NotBefore"))
            known = self._known.get(event_id)
            if known is not None:
                if deadline is not None and known.deadline != deadline:
                    # NotBefore restated (Azure may move it): the same event, a new deadline.
                    # (An event that started has none: it keeps the one it had.)
                    self._known[event_id] = replace(known, deadline=deadline)
                    notices.append(self._known[event_id])
                continue
            notice = Notice(
                source="azure",
                kind=EVENT_KINDS[event["EventType"]],
                id=event_id,
                noticed_at=now,
                deadline=deadline,
                detail={
                    "event_type": event["EventType"],
                    "event_status": event.get("EventStatus"),
                    "resources": event.get("Resources"),
                    "not_before": event.get("NotBefore"),
                    "description": event.get("Description"),
                    "event_source": event.get("EventSource"),
                    "duration_seconds": event.get("DurationInSeconds"),
                    "document_incarnation": self.incarnation,
                },
            )
            self._known[event_id] = notice
            notices.append(notice)
        for event_id in [i for i in self._known if i not in current]:
            # Gone from the document (completed, or cancelled by Azure before it started),
            # or not ours after all now that the VM name is known.
            earlier = self._known.pop(event_id)
            log.info("scheduled event gone", id=event_id, kind=earlier.kind)
            notices.append(
                Notice(
                    source="azure",
                    kind=earlier.kind,
                    id=event_id,
                    noticed_at=now,
                    deadline=None,
                    detail={**earlier.detail, "document_incarnation": self.incarnation},
                    cancelled=True,
                )
            )
        return notices

    @asynccontextmanager
    async def _ack_session(self) -> AsyncIterator[aiohttp.ClientSession]:
        session = self._session or self._active_session
        if session is not None and not session.closed:
            yield session
            return
        async with aiohttp.ClientSession() as own:
            yield own


def _validate(document: Any) -> None:
    """Raise unless ``document`` has the documented shape.

    The whole document is refused if one event is malformed: a partial reading could
    drop a known event and raise a false cancellation.
    """
    if not isinstance(document, dict) or not isinstance(document.get("Events"), list):
        raise BadResponse("not a scheduled-events document")
    for event in document["Events"]:
        if not isinstance(event, dict):
            raise BadResponse("event is not an object")
        if not isinstance(event.get("EventId"), str) or not event["EventId"]:
            raise BadResponse("event without EventId")
        if not isinstance(event.get("EventType"), str):
            raise BadResponse("event without EventType")


def _parse_not_before(value: Any) -> datetime | None:
    """RFC 1123 ("Mon, 19 Sep 2016 18:29:47 GMT"); empty (event started) -> None."""
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        parsed = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError):
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
