"""AWS: spot interruption, rebalance recommendation and scheduled maintenance, via IMDSv2.

What the EC2 instance metadata service does (and what this module relies on):

- IMDSv2 session: ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
  (1 to 21600) returns a token as ``text/plain``; every GET carries it in
  ``X-aws-ec2-metadata-token``. A GET with a missing, invalid or expired token gets
  ``401`` when IMDSv2 is required: the recommended action is a new token. ``400`` means a
  bad PUT, ``403`` IMDS turned off, ``404`` no such item, ``503`` retry. PUTs carrying
  ``X-Forwarded-For`` are rejected, and the PUT's response has an IP hop limit of 1 by
  default (so from a container behind a bridge the PUT times out: that is when
  ``imdsv1_fallback`` may help).
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instance-metadata-v2-how-it-works.html
- ``/latest/meta-data/spot/instance-action``: 404 until EC2 decides to interrupt, then
  ``{"action": "terminate" | "stop" | "hibernate", "time": "2017-09-18T08:22:00Z"}``
  (about two minutes ahead; hibernation starts at once). AWS suggests checking every 5 s.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
- ``/latest/meta-data/events/recommendations/rebalance``: 404 until emitted, then
  ``{"noticeTime": "2020-11-05T08:22:00Z"}`` (elevated risk; no deadline).
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html
- ``/latest/meta-data/events/maintenance/scheduled``: a JSON list of
  ``{"NotBefore": "21 Jan 2019 09:00:43 GMT", "Code": "system-reboot", "Description",
  "EventId": "instance-event-0d59937288b749b32", "NotAfter", "State": "active"}``;
  completed or canceled events move to ``events/maintenance/history``.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/monitoring-instances-status-check_sched.html
  (same shape as aws-node-termination-handler's ``pkg/ec2metadata/ec2metadata.go``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import structlog

from ckptd.notices.client import BadResponse, MetadataSource, describe_error, session_scope
from ckptd.notices.model import Clock, Notice, RateLimitedLog, Sleep, parse_time, utc_now

TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
SPOT_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
SCHEDULED_PATH = "/latest/meta-data/events/maintenance/scheduled"

MAX_TOKEN_TTL = 21600  # six hours, the documented maximum
HINT_INTERVAL_SECONDS = 300.0

#: instance-action "action" -> Notice.kind
SPOT_KINDS: dict[str, str] = {
    "terminate": "spot-termination",
    "stop": "spot-stop",
    "hibernate": "spot-hibernate",
}

_SCHEDULED_TIME_FORMAT = "%d %b %Y %H:%M:%S GMT"  # "21 Jan 2019 09:00:43 GMT"

log = structlog.get_logger("ckptd.notices.aws")


@dataclass
class _Response:
    status: int
    text: str


class AwsImdsSource(MetadataSource):
    """Polls IMDSv2 for spot interruption, rebalance and scheduled-maintenance notices."""

    name = "aws"

    def __init__(
        self,
        endpoint: str = "http://169.254.169.254",
        poll_interval: float = 1.0,
        token_ttl: int = MAX_TOKEN_TTL,
        imdsv1_fallback: bool = False,
        session: aiohttp.ClientSession | None = None,
        *,
        request_timeout: float = 2.0,
        token_retry_interval: float = 60.0,
        clock: Clock = utc_now,
        sleep: Sleep = asyncio.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        log_interval: float = 60.0,
    ) -> None:
        if not 1 <= token_ttl <= MAX_TOKEN_TTL:
            raise ValueError(f"token_ttl must be 1..{MAX_TOKEN_TTL} seconds, got {token_ttl}")
        super().__init__(
            endpoint,
            session=session,
            clock=clock,
            sleep=sleep,
            monotonic=monotonic,
            log=log,
            log_interval=log_interval,
        )
        self.poll_interval = poll_interval
        self.token_ttl = token_ttl
        self.imdsv1_fallback = imdsv1_fallback
        self.request_timeout = request_timeout
        self.token_retry_interval = token_retry_interval
        self._token: str | None = None
        self._token_refresh_at = 0.0
        self._skip_token_until = 0.0
        self._token_lock = asyncio.Lock()
        # Each notice yielded, by id, with the deadline it was yielded with.
        self._seen: dict[str, datetime | None] = {}
        # The items present at the last read, and how often each appeared: an item that
        # went (404) and came back is a new notice; one restated while present is not.
        self._present: set[str] = set()
        self._appearances: dict[str, int] = {}
        # The hop-limit hint: once, then at most every HINT_INTERVAL_SECONDS.
        self._hint = RateLimitedLog(log, HINT_INTERVAL_SECONDS, monotonic)

    async def acknowledge(self, notice: Notice) -> None:
        """AWS has nothing to acknowledge."""

    async def watch(self) -> AsyncIterator[Notice]:
        """Poll every ``poll_interval`` seconds; yield each new notice once."""
        async with session_scope(self._session) as session:
            while True:
                try:
                    notices = await self.poll_once(session)
                except Exception as exc:  # noqa: BLE001 - a bug here must not end the watch
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

    async def poll_once(self, session: aiohttp.ClientSession) -> list[Notice]:
        """One round over the three items; returns the notices not seen before, and
        those seen before whose deadline moved (the same id: an update, not a notice)."""
        token = await self._get_token(session)
        if token is None and not self.imdsv1_fallback:
            return []
        # The three reads are independent; doing them together keeps a hung endpoint
        # from delaying the spot check by more than one request timeout.
        results = await asyncio.gather(
            self._read(session, "spot", SPOT_PATH, self._parse_spot),
            self._read(session, "rebalance", REBALANCE_PATH, self._parse_rebalance),
            self._read(session, "scheduled", SCHEDULED_PATH, self._parse_scheduled),
        )
        fresh: list[Notice] = []
        for notices in results:
            for notice in notices:
                if notice.id not in self._seen or self._seen[notice.id] != notice.deadline:
                    self._seen[notice.id] = notice.deadline
                    fresh.append(notice)
        return fresh

    # -- token -------------------------------------------------------------------------

    async def _get_token(self, session: aiohttp.ClientSession) -> str | None:
        async with self._token_lock:
            now = self._monotonic()
            if self._token is not None and now < self._token_refresh_at:
                return self._token
            self._token = None
            if now < self._skip_token_until:
                return None  # IMDSv1 fallback in use; do not pay a PUT timeout every poll
            url = self.endpoint + TOKEN_PATH
            try:
                async with session.put(
                    url,
                    headers={TOKEN_TTL_HEADER: str(self.token_ttl)},
                    timeout=aiohttp.ClientTimeout(total=self.request_timeout),
                ) as resp:
                    body = await resp.text()
                    if resp.status == 403:
                        raise BadResponse(
                            "token PUT answered HTTP 403: the instance metadata service is "
                            "turned off (aws ec2 modify-instance-metadata-options "
                            "--http-endpoint enabled)"
                        )
                    if resp.status != 200:
                        raise BadResponse(f"token PUT answered HTTP {resp.status}")
            except TimeoutError:
                self._token_timed_out(url)
                if self.imdsv1_fallback:
                    self._skip_token_until = self._monotonic() + self.token_retry_interval
                return None
            except (aiohttp.ClientError, BadResponse) as exc:
                self._warn.warning(
                    "token",
                    "imds token request failed",
                    url=url,
                    error=describe_error(exc),
                    fallback="imdsv1" if self.imdsv1_fallback else None,
                )
                if self.imdsv1_fallback:
                    self._skip_token_until = self._monotonic() + self.token_retry_interval
                return None
            token = body.strip()
            if not token or any(c.isspace() for c in token):
                self._warn.warning("token", "imds token response is not a token", url=url)
                return None
            self._warn.recovered("token", "imds token request works again")
            # Refresh well before expiry so no poll ever races the TTL: a minute early
            # for long TTLs, half-way for short ones.
            lifetime = max(self.token_ttl - 60, self.token_ttl / 2)
            self._token = token
            self._token_refresh_at = self._monotonic() + lifetime
            return token

    def _token_timed_out(self, url: str) -> None:
        """The token PUT got no answer: most often the hop limit, said with its fix."""
        self.health.failed("token", "timeout")
        self._hint.warning(
            "token-timeout",
            "imds_token_timeout",
            url=url,
            why="the IMDSv2 token PUT got no answer: from a container behind a bridge the "
            "instance's metadata hop limit of 1 drops the reply, so no notice can be heard",
            fix="aws ec2 modify-instance-metadata-options --instance-id <id> "
            "--http-put-response-hop-limit 2 (or hostNetwork, or [preemption] "
            "imdsv1_fallback = true)",
            fallback="imdsv1" if self.imdsv1_fallback else None,
        )

    async def _invalidate_token(self, stale: str | None) -> None:
        async with self._token_lock:
            if self._token == stale:
                self._token = None
            # A 401 also means IMDSv2 is required: stop skipping the PUT (v1 fallback).
            self._skip_token_until = 0.0

    # -- reads -------------------------------------------------------------------------

    async def _get(self, session: aiohttp.ClientSession, path: str) -> _Response:
        """GET with the current token; on 401 get a fresh token and retry once."""
        url = self.endpoint + path
        for attempt in range(2):
            token = await self._get_token(session)
            if token is None and not self.imdsv1_fallback:
                raise BadResponse("no IMDSv2 token")
            headers = {TOKEN_HEADER: token} if token is not None else {}
            async with session.get(
                url,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
                allow_redirects=False,
            ) as resp:
                text = await resp.text(errors="replace")
                if resp.status == 401 and attempt == 0:
                    # Token expired or was revoked (the documented meaning of 401).
                    await self._invalidate_token(token)
                    continue
                return _Response(resp.status, text)
        raise BadResponse("HTTP 401 even with a fresh token")

    async def _read(
        self,
        session: aiohttp.ClientSession,
        key: str,
        path: str,
        parse: Callable[[str, datetime], list[Notice]],
    ) -> list[Notice]:
        try:
            resp = await self._get(session, path)
            if resp.status == 404:
                notices: list[Notice] = []  # the documented "nothing yet"
                self._present.discard(key)
            elif resp.status == 200:
                notices = parse(resp.text, self._clock())
            else:
                raise BadResponse(f"HTTP {resp.status}")
        except (aiohttp.ClientError, TimeoutError, BadResponse, ValueError) as exc:
            self._warn.warning(
                key, "imds read failed", url=self.endpoint + path, error=describe_error(exc)
            )
            return []
        self._warn.recovered(key, "imds read works again", url=self.endpoint + path)
        return notices

    def _appearance(self, key: str) -> int:
        """Which appearance of ``key`` (``spot``, ``rebalance``) a 200 is: the same number
        while it stays, the next once it went (404) and came back."""
        if key not in self._present:
            self._present.add(key)
            self._appearances[key] = self._appearances.get(key, 0) + 1
        return self._appearances[key]

    # -- parsing -----------------------------------------------------------------------

    def _parse_spot(self, text: str, now: datetime) -> list[Notice]:
        data = _json_object(text)
        action, when = data.get("action"), data.get("time")
        if not isinstance(action, str) or action not in SPOT_KINDS:
            raise BadResponse(f"unknown spot action {action!r}")
        if not isinstance(when, str):
            raise BadResponse("spot instance-action without a time")
        deadline = parse_time(when)
        return [
            Notice(
                source="aws",
                kind=SPOT_KINDS[action],
                # The action (and which appearance of the item) identifies the notice;
                # its time may be restated (an endpoint that moves it on every read once
                # made a new notice every poll): that moves the deadline of this one.
                id=f"spot:{action}:{self._appearance('spot')}",
                noticed_at=now,
                deadline=deadline,
                detail={"action": action, "time": when},
            )
        ]

    def _parse_rebalance(self, text: str, now: datetime) -> list[Notice]:
        data = _json_object(text)
        notice_time = data.get("noticeTime")
        if not isinstance(notice_time, str):
            raise BadResponse("rebalance recommendation without noticeTime")
        parse_time(notice_time)  # validates; a rebalance has no deadline of its own
        return [
            Notice(
                source="aws",
                kind="rebalance",
                # One recommendation while it stays, however often its time is restated.
                id=f"rebalance:{self._appearance('rebalance')}",
                noticed_at=now,
                deadline=None,
                detail={"noticeTime": notice_time},
            )
        ]

    def _parse_scheduled(self, text: str, now: datetime) -> list[Notice]:
        data = json.loads(text) if text.strip() else []
        if not isinstance(data, list):
            raise BadResponse("scheduled events is not a JSON list")
        notices = []
        for event in data:
            if not isinstance(event, dict) or not isinstance(event.get("EventId"), str):
                raise BadResponse("scheduled event without an EventId")
            state = str(event.get("State") or "active").lower()
            description = str(event.get("Description") or "")
            # Only upcoming events matter; a canceled or completed one is history.
            if state in ("canceled", "cancelled", "completed") or description.startswith(
                ("[Canceled]", "[Completed]")
            ):
                continue
            notices.append(
                Notice(
                    source="aws",
                    kind="maintenance",
                    id=f"maintenance:{event['EventId']}",
                    noticed_at=now,
                    deadline=_parse_scheduled_time(event.get("NotBefore")),
                    detail={
                        "event_id": event["EventId"],
                        "code": event.get("Code"),
                        "description": description,
                        "not_before": event.get("NotBefore"),
                        "not_after": event.get("NotAfter"),
                        "state": event.get("State"),
                    },
                )
            )
        return notices


def _json_object(text: str) -> dict[str, Any]:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise BadResponse("expected a JSON object")
    return data


def _parse_scheduled_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        return datetime.strptime(value.strip(), _SCHEDULED_TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        try:
            return parse_time(value)
        except ValueError:
            return None
