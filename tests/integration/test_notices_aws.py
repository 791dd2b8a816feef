"""AWS IMDSv2 notice source against a loopback fake of IMDS (real time, short polls)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest

from ckptd.notices.aws import AwsImdsSource
from tests.support.fakes import Collector, free_port, wait_until
from tests.support.fakes.aws_imds import TOKEN_HEADER, TTL_HEADER, FakeAwsImds

POLL = 0.05
SPOT = "/latest/meta-data/spot/instance-action"
TOKEN = "/latest/api/token"


@pytest.fixture
async def imds() -> AsyncIterator[FakeAwsImds]:
    async with FakeAwsImds() as fake:
        yield fake


def make(endpoint: str, **kw: Any) -> AwsImdsSource:
    kw.setdefault("request_timeout", 0.3)
    return AwsImdsSource(endpoint, poll_interval=POLL, **kw)


def whole_seconds(dt: datetime) -> datetime:
    return dt.replace(microsecond=0)


async def polls_seen(fake: FakeAwsImds, n: int, path: str = SPOT, **kw: Any) -> None:
    since = time.monotonic()
    await wait_until(lambda: fake.count(path, since=since, **kw) >= n, what=f"{n} polls")


# -- notices ---------------------------------------------------------------------------


async def test_no_notice_yields_nothing(imds: FakeAwsImds) -> None:
    async with Collector(make(imds.url)) as notices:
        await polls_seen(imds, 3, status=404)
        await notices.expect_nothing(0.3)


@pytest.mark.parametrize(
    ("action", "kind"),
    [("terminate", "spot-termination"), ("stop", "spot-stop"), ("hibernate", "spot-hibernate")],
)
async def test_spot_interruption_is_yielded_once_with_its_deadline(
    imds: FakeAwsImds, action: str, kind: str
) -> None:
    at = whole_seconds(datetime.now(UTC) + timedelta(minutes=2))
    async with Collector(make(imds.url)) as notices:
        imds.trigger_spot(action, at=at)
        notice = await notices.next(3)
        assert (notice.source, notice.kind, notice.deadline) == ("aws", kind, at)
        assert notice.id == f"spot:{action}:1"
        assert not notice.cancelled
        # Later polls see the same instance-action: no second notice.
        await polls_seen(imds, 5, status=200)
        await notices.expect_nothing(0.1)


async def test_a_spot_time_restated_on_every_read_is_one_notice_whose_deadline_moves(
    imds: FakeAwsImds,
) -> None:
    """An endpoint that moves the announced time every poll once made a new notice every
    second: the action identifies the notice; a moved time comes as the same id again."""
    async with Collector(make(imds.url)) as notices:
        imds.trigger_spot_moving("terminate", ahead=120)
        first = await notices.next(3)
        # The time is stated to the second: within ~1.2 s it has moved at least once.
        moved = await notices.next(3)
        assert first.id == moved.id == "spot:terminate:1"
        assert first.deadline is not None and moved.deadline is not None
        assert moved.deadline > first.deadline


async def test_rebalance_recommendation_has_no_deadline(imds: FakeAwsImds) -> None:
    async with Collector(make(imds.url)) as notices:
        notice_time = imds.trigger_rebalance()
        notice = await notices.next(3)
        assert notice.kind == "rebalance"
        assert notice.deadline is None
        assert notice.detail["noticeTime"] == notice_time
        await polls_seen(imds, 5, "/latest/meta-data/events/recommendations", status=200)
        await notices.expect_nothing(0.1)


async def test_only_active_scheduled_maintenance_is_a_notice(imds: FakeAwsImds) -> None:
    imds.add_maintenance(state="canceled")
    imds.add_maintenance(state="completed", description="[Completed] scheduled reboot")
    not_before = whole_seconds(datetime.now(UTC) + timedelta(hours=3))
    active = imds.add_maintenance("system-maintenance", not_before=not_before)
    async with Collector(make(imds.url)) as notices:
        notice = await notices.next(3)
        assert (notice.kind, notice.id, notice.deadline) == (
            "maintenance",
            f"maintenance:{active}",
            not_before,
        )
        assert notice.detail["code"] == "system-maintenance"
        await polls_seen(imds, 5, "/latest/meta-data/events/maintenance", status=200)
        await notices.expect_nothing(0.1)


async def test_notice_arrives_within_one_poll_interval(imds: FakeAwsImds) -> None:
    async with Collector(make(imds.url)) as notices:
        await polls_seen(imds, 2, status=404)
        triggered = time.monotonic()
        imds.trigger_spot()
        await notices.next(3)
        latency = notices.received[0][0] - triggered
        assert latency < 1.0, f"notice took {latency:.3f} s with {POLL} s polls"


# -- bad responses ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["garbage", "wrong-shape", "500", "503", "hang"])
async def test_bad_responses_raise_no_notice_and_the_watch_goes_on(
    imds: FakeAwsImds, mode: str
) -> None:
    imds.set_mode(mode)
    async with Collector(make(imds.url)) as notices:
        await polls_seen(imds, 2 if mode == "hang" else 4)
        await notices.expect_nothing(0.2)
        imds.set_mode("ok")
        imds.trigger_spot()
        assert (await notices.next(3)).kind == "spot-termination"


async def test_dead_endpoint_raises_nothing_and_recovers() -> None:
    port = free_port()  # nothing listens: connections are refused
    ticks = 0

    async def counting_sleep(delay: float) -> None:
        nonlocal ticks
        ticks += 1
        await asyncio.sleep(delay)

    source = make(f"http://127.0.0.1:{port}", sleep=counting_sleep)
    async with Collector(source) as notices:
        await wait_until(lambda: ticks >= 5, what="polls against a closed port")
        await notices.expect_nothing(0.1)
        fake = FakeAwsImds()
        await fake.start(port=port)
        try:
            fake.trigger_spot()
            assert (await notices.next(3)).kind == "spot-termination"
        finally:
            await fake.stop()


# -- IMDSv2 tokens ---------------------------------------------------------------------


async def test_every_request_uses_an_imdsv2_token(imds: FakeAwsImds) -> None:
    async with Collector(make(imds.url)) as notices:
        await polls_seen(imds, 3, status=404)
        await notices.expect_nothing(0)
    puts = [r for r in imds.requests if r.method == "PUT"]
    gets = [r for r in imds.requests if r.method == "GET"]
    assert len(puts) == 1 and puts[0].path == TOKEN
    assert puts[0].header(TTL_HEADER) == "21600"
    assert puts[0].header("X-Forwarded-For") is None
    assert gets and all(r.header(TOKEN_HEADER) for r in gets)
    assert imds.count(status=401) == 0


async def test_expired_token_gets_401_then_a_new_token(imds: FakeAwsImds) -> None:
    async with Collector(make(imds.url)) as notices:
        await polls_seen(imds, 2, status=404)
        assert imds.tokens_issued == 1
        imds.expire_tokens()
        await wait_until(lambda: imds.tokens_issued >= 2, what="a new token")
        assert imds.count(SPOT, status=401) >= 1
        imds.trigger_spot()
        assert (await notices.next(3)).kind == "spot-termination"


async def test_token_is_renewed_before_it_expires(imds: FakeAwsImds) -> None:
    async with Collector(make(imds.url, token_ttl=1)) as notices:
        await wait_until(lambda: imds.tokens_issued >= 3, timeout=5, what="token renewals")
        await notices.expect_nothing(0)
    assert imds.count(status=401) == 0


async def test_without_a_token_nothing_is_read_unless_imdsv1_is_allowed(
    imds: FakeAwsImds,
) -> None:
    imds.set_token_mode("forbidden")  # as when IMDS refuses sessions
    imds.set_imdsv2_required(False)
    imds.trigger_spot()
    async with Collector(make(imds.url)) as notices:
        await wait_until(lambda: imds.count(TOKEN, status=403) >= 3, what="token attempts")
        await notices.expect_nothing(0.1)
    assert imds.count(SPOT) == 0
    async with Collector(make(imds.url, imdsv1_fallback=True)) as notices:
        assert (await notices.next(3)).kind == "spot-termination"
    assert any(r.header(TOKEN_HEADER) is None for r in imds.requests if r.path == SPOT)


async def test_token_put_lost_to_the_hop_limit_falls_back_to_imdsv1(imds: FakeAwsImds) -> None:
    imds.set_token_mode("hang")
    imds.set_imdsv2_required(False)
    imds.trigger_spot()
    async with Collector(make(imds.url, imdsv1_fallback=True, request_timeout=0.2)) as notices:
        assert (await notices.next(3)).kind == "spot-termination"
        await polls_seen(imds, 3, status=200)
    # One lost PUT, then IMDSv1 for a while: no PUT timeout paid on every poll.
    assert imds.count(TOKEN) == 1


# -- the fake is faithful to IMDS ------------------------------------------------------


async def test_fake_imds_enforces_the_documented_rules(imds: FakeAwsImds) -> None:
    async with aiohttp.ClientSession() as http:

        async def put(headers: dict[str, str]) -> int:
            async with http.put(imds.url + TOKEN, headers=headers) as resp:
                return resp.status

        async def get(headers: dict[str, str]) -> int:
            async with http.get(imds.url + SPOT, headers=headers) as resp:
                return resp.status

        assert await put({}) == 400
        assert await put({TTL_HEADER: "0"}) == 400
        assert await put({TTL_HEADER: "21601"}) == 400
        assert await put({TTL_HEADER: "60", "X-Forwarded-For": "10.0.0.1"}) == 403
        assert await get({}) == 401  # IMDSv2 required
        assert await get({TOKEN_HEADER: "forged"}) == 401
        async with http.put(imds.url + TOKEN, headers={TTL_HEADER: "60"}) as resp:
            assert resp.status == 200
            assert resp.content_type == "text/plain"
            assert resp.headers[TTL_HEADER] == "60"
            token = await resp.text()
        assert await get({TOKEN_HEADER: token}) == 404  # no notice yet
        imds.expire_tokens()
        assert await get({TOKEN_HEADER: token}) == 401


def test_fake_runs_in_a_background_thread() -> None:
    with FakeAwsImds() as imds:
        imds.trigger_spot("stop")

        async def first_notice() -> str:
            async with Collector(make(imds.url)) as notices:
                return (await notices.next(3)).kind

        assert asyncio.run(first_notice()) == "spot-stop"


async def test_a_spot_action_that_goes_and_comes_back_is_a_new_notice(imds: FakeAwsImds) -> None:
    async with Collector(make(imds.url)) as notices:
        imds.trigger_spot("terminate")
        first = await notices.next(3)
        imds.clear_spot()
        await polls_seen(imds, 2, status=404)
        imds.trigger_spot("terminate")
        second = await notices.next(3)
    assert (first.id, second.id) == ("spot:terminate:1", "spot:terminate:2")
