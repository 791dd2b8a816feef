"""A fake EC2 instance metadata service (IMDSv2) on loopback.

Behaviour, as documented:

- ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` = 1..21600,
  else 400; a PUT with ``X-Forwarded-For`` is rejected (403 here); the token comes back
  as ``text/plain`` with the TTL header echoed.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instance-metadata-v2-how-it-works.html
- GETs carry ``X-aws-ec2-metadata-token``. An unknown or expired token gets 401; with
  IMDSv2 required, so does a GET without one. All items are ``text/plain``; a missing
  item is 404; 503 means retry. GET responses echo the token's remaining TTL.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html
- ``spot/instance-action``: 404, or ``{"action": "terminate", "time": "2017-09-18T08:22:00Z"}``.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
- ``events/recommendations/rebalance``: 404, or ``{"noticeTime": "2020-11-05T08:22:00Z"}``.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html
- ``events/maintenance/scheduled``: a JSON list (``[]`` when there is none) of
  ``{"NotBefore": "21 Jan 2019 09:00:43 GMT", "Code": "system-reboot", "Description":
  "scheduled reboot", "EventId": "instance-event-0d59937288b749b32", "NotAfter": "21 Jan
  2019 09:17:23 GMT", "State": "active"}``. (The fake serves whatever state it is given,
  so a client's filtering of canceled/completed events can be tested.)
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/monitoring-instances-status-check_sched.html

Extra modes: the global ``set_mode`` applies to metadata GETs; ``set_token_mode`` to the
token PUT (``ok``, ``forbidden`` = 403 as with IMDS turned off, ``hang`` = the PUT's
answer never arrives, as with the hop limit of 1 from a container, ``500``).
"""

from __future__ import annotations

import json
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from tests.support.fakes import FakeServer

TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TTL = 21600
INSTANCE_ID = "i-0123456789abcdef0"
TOKEN_MODES = frozenset({"ok", "forbidden", "hang", "500"})


def rfc3339(value: datetime) -> str:
    """The time format of instance-action and noticeTime: ``2017-09-18T08:22:00Z``."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def scheduled_time(value: datetime) -> str:
    """The time format of scheduled events: ``21 Jan 2019 09:00:43 GMT``."""
    return value.astimezone(UTC).strftime("%d %b %Y %H:%M:%S GMT")


class FakeAwsImds(FakeServer):
    """IMDSv2 with spot, rebalance and scheduled-maintenance items."""

    def __init__(self, *, imdsv2_required: bool = True) -> None:
        super().__init__()
        self.imdsv2_required = imdsv2_required
        self._token_mode = "ok"
        self._tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.tokens_issued = 0
        self._spot: dict[str, str] | None = None
        self._spot_ahead: float | None = None  # trigger_spot_moving: time = now + this
        self._rebalance: dict[str, str] | None = None
        self._scheduled: list[dict[str, str]] = []
        self._raw: dict[str, str] = {}

    # -- control API -------------------------------------------------------------------

    def set_raw(self, item: str, body: str | None) -> None:
        """Serve ``body`` verbatim (200) for ``item`` (e.g. ``spot/instance-action``),
        whatever its shape; None goes back to the documented answer. For fuzzing."""
        with self._lock:
            if body is None:
                self._raw.pop(item, None)
            else:
                self._raw[item] = body
            self._version += 1

    def trigger_spot(self, action: str = "terminate", at: datetime | None = None) -> str:
        """Publish a spot instance-action; ``at`` defaults to two minutes from now.

        Returns the ``time`` string served.
        """
        when = rfc3339(at or datetime.now(UTC) + timedelta(minutes=2))
        with self._lock:
            self._spot = {"action": action, "time": when}
            self._spot_ahead = None
        self._changed()
        return when

    def trigger_spot_moving(self, action: str = "terminate", ahead: float = 120.0) -> None:
        """Publish a spot instance-action whose ``time`` is restated on every read as
        ``ahead`` seconds from then: an endpoint whose announced time moves every poll."""
        with self._lock:
            self._spot = {"action": action, "time": ""}
            self._spot_ahead = ahead
        self._changed()

    def clear_spot(self) -> None:
        """Back to 404 on instance-action."""
        with self._lock:
            self._spot = None
            self._spot_ahead = None
        self._changed()

    def trigger_rebalance(self, at: datetime | None = None) -> str:
        """Publish a rebalance recommendation; returns its ``noticeTime``."""
        when = rfc3339(at or datetime.now(UTC))
        with self._lock:
            self._rebalance = {"noticeTime": when}
        self._changed()
        return when

    def add_maintenance(
        self,
        code: str = "system-reboot",
        not_before: datetime | None = None,
        *,
        not_after: datetime | None = None,
        state: str = "active",
        description: str = "scheduled reboot",
        event_id: str | None = None,
    ) -> str:
        """Schedule a maintenance event (``not_before`` defaults to a day ahead); its id."""
        start = not_before or datetime.now(UTC) + timedelta(days=1)
        event_id = event_id or f"instance-event-{secrets.token_hex(8)}"
        event = {
            "NotBefore": scheduled_time(start),
            "Code": code,
            "Description": description,
            "EventId": event_id,
            "NotAfter": scheduled_time(not_after or start + timedelta(minutes=30)),
            "State": state,
        }
        with self._lock:
            self._scheduled.append(event)
        self._changed()
        return event_id

    def set_maintenance_state(self, event_id: str, state: str) -> None:
        """Change an event's ``State`` (e.g. ``canceled``)."""
        with self._lock:
            for event in self._scheduled:
                if event["EventId"] == event_id:
                    event["State"] = state
        self._changed()

    def remove_maintenance(self, event_id: str) -> None:
        """Drop an event from the scheduled list."""
        with self._lock:
            self._scheduled = [e for e in self._scheduled if e["EventId"] != event_id]
        self._changed()

    def expire_tokens(self) -> None:
        """Make every issued token expired: the next GET with one gets 401."""
        with self._lock:
            now = time.monotonic()
            self._tokens = {token: now for token in self._tokens}
        self._changed()

    def set_token_mode(self, mode: str) -> None:
        """Fault mode of the token PUT (see the module docstring)."""
        if mode not in TOKEN_MODES:
            raise ValueError(f"unknown token mode {mode!r}")
        with self._lock:
            self._token_mode = mode
        self._changed()

    def set_imdsv2_required(self, required: bool) -> None:
        """Whether a GET without a token is refused (401) or served (IMDSv1)."""
        with self._lock:
            self.imdsv2_required = required
        self._changed()

    # -- HTTP --------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        app.router.add_put("/latest/api/token", self._token)
        app.router.add_get("/latest/meta-data/{item:.*}", self._meta_data)

    async def _token(self, request: web.Request) -> web.StreamResponse:
        if "X-Forwarded-For" in request.headers:
            return _text(403, "Forbidden")
        with self._lock:
            token_mode = self._token_mode
        if token_mode == "hang":
            while self._token_mode == "hang":
                await self.wait_for_change(self._version, 1.0)
            with self._lock:
                token_mode = self._token_mode  # what it answers once it stops hanging
        if token_mode == "forbidden":
            return _text(403, "Forbidden")
        elif token_mode == "500":
            return _text(500, "Internal Server Error")
        raw = request.headers.get(TTL_HEADER, "")
        try:
            ttl = int(raw)
        except ValueError:
            return _text(400, "Missing or Invalid Parameters")
        if not 1 <= ttl <= MAX_TTL:
            return _text(400, "Missing or Invalid Parameters")
        token = secrets.token_urlsafe(42)
        with self._lock:
            self._tokens[token] = time.monotonic() + ttl
            self.tokens_issued += 1
        return _text(200, token, {TTL_HEADER: str(ttl)})

    async def _meta_data(self, request: web.Request) -> web.StreamResponse:
        mode = self.mode
        if mode == "hang":
            await self.hang()
            mode = self.mode
        if mode in ("500", "503"):
            return _text(int(mode), "error")
        extra: dict[str, str] = {}
        token = request.headers.get(TOKEN_HEADER)
        with self._lock:
            if token is not None:
                expiry = self._tokens.get(token)
                left = (expiry or 0) - time.monotonic()
                if expiry is None or left <= 0:
                    return _text(401, "Unauthorized")
                extra[TTL_HEADER] = str(int(left))
            elif self.imdsv2_required:
                return _text(401, "Unauthorized")
            spot, rebalance = self._spot, self._rebalance
            if spot is not None and self._spot_ahead is not None:
                spot = {
                    **spot,
                    "time": rfc3339(datetime.now(UTC) + timedelta(seconds=self._spot_ahead)),
                }
            scheduled = [dict(e) for e in self._scheduled]
            raw = dict(self._raw)
        item = request.match_info["item"]
        if item in raw:
            return _text(200, raw[item], extra)
        if mode == "garbage":
            return _text(200, '<html>{"action": "termin', extra)
        if mode == "wrong-shape":
            return _text(200, json.dumps(_WRONG_SHAPES.get(item, {"x": 1})), extra)
        body: Any
        if item == "spot/instance-action":
            body = spot
        elif item == "events/recommendations/rebalance":
            body = rebalance
        elif item == "events/maintenance/scheduled":
            body = scheduled
        elif item == "instance-id":
            return _text(200, INSTANCE_ID, extra)
        else:
            body = None
        if body is None:
            return _text(404, "Not Found", extra)
        return _text(200, json.dumps(body, indent=2), extra)


_WRONG_SHAPES: dict[str, Any] = {
    "spot/instance-action": {"action": "explode", "time": "soon"},
    "events/recommendations/rebalance": {"noticeTime": 12},
    "events/maintenance/scheduled": [{"Code": "system-reboot", "State": "active"}],
}


def _text(status: int, body: str, headers: dict[str, str] | None = None) -> web.Response:
    # IMDS answers everything as text/plain, JSON items included.
    return web.Response(status=status, text=body, content_type="text/plain", headers=headers)
