"""A fake Azure Instance Metadata Service (Scheduled Events and compute/name) on loopback.

Behaviour, as documented:

- Every request needs ``Metadata: true`` and no ``X-Forwarded-For``, else 400 Bad
  Request; ``api-version`` is mandatory (400 listing the newest versions otherwise); a
  leaf node such as ``compute/name`` needs ``format=text`` (400 otherwise).
  https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service#errors-and-debugging
- ``GET /metadata/scheduledevents?api-version=2020-07-01``:
  ``{"DocumentIncarnation": n, "Events": [{"EventId", "EventStatus": "Scheduled" |
  "Started", "EventType": "Reboot" | "Redeploy" | "Freeze" | "Preempt" | "Terminate",
  "ResourceType": "VirtualMachine", "Resources": [names], "NotBefore": "Mon, 19 Sep 2016
  18:29:47 GMT" (empty once started), "Description", "EventSource": "Platform" | "User",
  "DurationInSeconds": -1}]}``; the incarnation goes up whenever the list changes. The
  first call may be slow (it enables the service): see ``first_call_delay``.
  https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events
- ``POST`` to the same URL with ``{"StartRequests": [{"EventId": "..."}]}``: 200 for valid
  EventIds (the event then starts: status ``Started``, empty ``NotBefore``), 400 for a
  malformed body or an unknown EventId.
  https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#start-an-event
- ``GET /metadata/instance/compute/name?api-version=2021-02-01&format=text``: the VM name.
  https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service#instance-metadata

Extra behaviour: ``vm_name=None`` makes ``compute/name`` answer 404, for tests of a VM
whose name cannot be learnt.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

from aiohttp import web

from tests.support.fakes import FakeServer

API_VERSIONS = frozenset({"2017-08-01", "2019-08-01", "2020-07-01", "2021-02-01", "2023-07-01"})

#: Documented minimum notice per EventType (the default NotBefore of ``add_event``).
MINIMUM_NOTICE = {
    "Freeze": timedelta(minutes=15),
    "Reboot": timedelta(minutes=15),
    "Redeploy": timedelta(minutes=10),
    "Preempt": timedelta(seconds=30),
    "Terminate": timedelta(minutes=5),
}


def rfc1123(value: datetime) -> str:
    """``Mon, 19 Sep 2016 18:29:47 GMT``."""
    return format_datetime(value.astimezone(UTC), usegmt=True)


class FakeAzureMetadata(FakeServer):
    """Scheduled Events with StartRequests, and compute/name."""

    MODES = FakeServer.MODES | {"410", "429"}

    def __init__(
        self,
        vm_name: str | None = "ckptd-test-vm",
        *,
        first_call_delay: float = 0.0,
        start_on_ack: bool = True,
    ) -> None:
        super().__init__()
        self.vm_name = vm_name
        self.first_call_delay = first_call_delay
        self.start_on_ack = start_on_ack
        self._events: dict[str, dict[str, Any]] = {}
        self.incarnation = 1
        self._acks: list[str] = []
        self._answered = False
        self._raw: str | None = None

    # -- control API -------------------------------------------------------------------

    def add_event(
        self,
        event_type: str = "Preempt",
        *,
        resources: list[str] | None = None,
        not_before: datetime | str | None = None,
        status: str = "Scheduled",
        event_id: str | None = None,
        source: str = "Platform",
        description: str = "Virtual machine is being evicted.",
        duration: int = -1,
    ) -> str:
        """Publish an event (for this VM unless ``resources`` says otherwise); its EventId.

        ``not_before`` defaults to now plus the documented minimum notice for the type;
        a string is served as given (``""`` for a started event).
        """
        if isinstance(not_before, str):
            nb = not_before
        else:
            nb = rfc1123(not_before or datetime.now(UTC) + MINIMUM_NOTICE[event_type])
        event_id = event_id or str(uuid.uuid4()).upper()
        event = {
            "EventId": event_id,
            "EventStatus": status,
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": resources if resources is not None else [self.vm_name or "vm"],
            "NotBefore": nb,
            "Description": description,
            "EventSource": source,
            "DurationInSeconds": duration,
        }
        with self._lock:
            self._events[event_id] = event
            self.incarnation += 1
        self._changed()
        return event_id

    def start_event(self, event_id: str) -> None:
        """Move an event to ``Started`` (``NotBefore`` becomes empty)."""
        with self._lock:
            event = self._events[event_id]
            event["EventStatus"], event["NotBefore"] = "Started", ""
            self.incarnation += 1
        self._changed()

    def remove_event(self, event_id: str) -> None:
        """Drop an event (it completed, or Azure cancelled it)."""
        with self._lock:
            self._events.pop(event_id, None)
            self.incarnation += 1
        self._changed()

    @property
    def acks(self) -> list[str]:
        """EventIds acknowledged with StartRequests, in order."""
        with self._lock:
            return list(self._acks)

    def set_raw(self, body: str | None) -> None:
        """Serve ``body`` verbatim (200) as the Scheduled Events document, whatever its
        shape; None goes back to the events added. For fuzzing."""
        with self._lock:
            self._raw = body
            self._version += 1

    def document(self) -> dict[str, Any]:
        """The Scheduled Events document as served now."""
        with self._lock:
            return {
                "DocumentIncarnation": self.incarnation,
                "Events": [dict(e) for e in self._events.values()],
            }

    # -- HTTP --------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metadata/scheduledevents", self._get_events)
        app.router.add_post("/metadata/scheduledevents", self._post_events)
        app.router.add_get("/metadata/instance/compute/name", self._compute_name)

    def _check(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Metadata") != "true" or "X-Forwarded-For" in request.headers:
            return _json(400, {"error": "Bad request. Required metadata header not specified"})
        if request.query.get("api-version") not in API_VERSIONS:
            return _json(
                400,
                {
                    "error": "Bad request. api-version is invalid or was not specified in "
                    "the request. For more information refer to aka.ms/azureimds",
                    "newest-versions": sorted(API_VERSIONS, reverse=True)[:3],
                },
            )
        return None

    async def _fault(self) -> web.Response | None:
        mode = self.mode
        if mode == "hang":
            await self.hang()
            mode = self.mode
        if mode in ("500", "503", "410", "429"):
            return _json(int(mode), {"error": f"fault {mode}"})
        return None

    async def _get_events(self, request: web.Request) -> web.StreamResponse:
        if (bad := self._check(request)) is not None:
            return bad
        if not self._answered and self.first_call_delay:
            await asyncio.sleep(self.first_call_delay)
        self._answered = True
        if (fault := await self._fault()) is not None:
            return fault
        mode = self.mode
        with self._lock:
            raw = self._raw
        if raw is not None:
            return web.Response(text=raw, content_type="application/json")
        if mode == "garbage":
            return web.Response(
                text='{"DocumentIncarnation": 3, "Events": [', content_type="application/json"
            )
        if mode == "wrong-shape":
            return _json(200, {"DocumentIncarnation": 3, "Events": [{"EventType": "Preempt"}]})
        return _json(200, self.document())

    async def _post_events(self, request: web.Request) -> web.StreamResponse:
        if (bad := self._check(request)) is not None:
            return bad
        if (fault := await self._fault()) is not None:
            return fault
        try:
            body = json.loads(await request.read())
            ids = [item["EventId"] for item in body["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            return _json(400, {"error": "Bad request. Malformed StartRequests"})
        with self._lock:
            if not ids or any(not isinstance(i, str) or i not in self._events for i in ids):
                return _json(400, {"error": "Bad request. Unknown EventId"})
            self._acks.extend(ids)
        if self.start_on_ack:
            for event_id in ids:
                self.start_event(event_id)
        return web.Response(status=200)

    async def _compute_name(self, request: web.Request) -> web.StreamResponse:
        if (bad := self._check(request)) is not None:
            return bad
        if request.query.get("format") != "text":
            return _json(400, {"error": "Bad request. Leaf nodes need format=text"})
        if (fault := await self._fault()) is not None:
            return fault
        if self.vm_name is None:
            return _json(404, {"error": "Not found"})
        return web.Response(text=self.vm_name, content_type="text/plain")


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")
