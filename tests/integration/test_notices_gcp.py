"""GCP metadata-server notice source against a loopback fake (real time, hanging GETs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import aiohttp
import pytest

from ckptd.notices.gcp import GcpMetadataSource
from tests.support.fakes import Collector, free_port, wait_until
from tests.support.fakes.gcp_metadata import FakeGcpMetadata, etag_of

PREEMPTED = "/computeMetadata/v1/instance/preempted"
MAINTENANCE = "/computeMetadata/v1/instance/maintenance-event"


@pytest.fixture
async def gcp() -> AsyncIterator[FakeGcpMetadata]:
    async with FakeGcpMetadata() as fake:
        yield fake


def make(endpoint: str, **kw: Any) -> GcpMetadataSource:
    kw.setdefault("request_timeout", 0.3)
    kw.setdefault("hang_timeout", 1)
    kw.setdefault("max_backoff", 0.2)
    return GcpMetadataSource(endpoint, retry_interval=0.05, **kw)


def hanging(fake: FakeGcpMetadata, path: str) -> int:
    """Hanging GETs received on ``path``."""
    return sum(1 for r in fake.requests if r.path == path and r.query.get("wait_for_change"))


async def both_watches_hanging(fake: FakeGcpMetadata) -> None:
    await wait_until(
        lambda: hanging(fake, PREEMPTED) >= 1 and hanging(fake, MAINTENANCE) >= 1,
        what="hanging GETs on both keys",
    )


# -- notices ---------------------------------------------------------------------------


async def test_no_notice_yields_nothing(gcp: FakeGcpMetadata) -> None:
    async with Collector(make(gcp.url)) as notices:
        await both_watches_hanging(gcp)
        await notices.expect_nothing(0.3)


async def test_preemption_is_yielded_once_with_a_30_second_deadline(gcp: FakeGcpMetadata) -> None:
    async with Collector(make(gcp.url)) as notices:
        await both_watches_hanging(gcp)
        gcp.preempt()
        notice = await notices.next(3)
        assert (notice.source, notice.kind, notice.id) == ("gcp", "preemption", "preempted")
        assert notice.deadline == notice.noticed_at + timedelta(seconds=30)
        # The next hanging GET (last_etag = TRUE's ETag) times out and re-reads TRUE.
        answered = gcp.count(PREEMPTED, status=200)
        await wait_until(lambda: gcp.count(PREEMPTED, status=200) > answered, what="a re-read")
        await notices.expect_nothing(0.05)


async def test_preempted_before_start_is_noticed_at_once(gcp: FakeGcpMetadata) -> None:
    gcp.preempt()
    async with Collector(make(gcp.url)) as notices:
        assert (await notices.next(3)).kind == "preemption"


@pytest.mark.parametrize(
    ("value", "notice_period"),
    [
        ("MIGRATE_ON_HOST_MAINTENANCE", timedelta(seconds=60)),
        ("TERMINATE_ON_HOST_MAINTENANCE", timedelta(minutes=60)),
    ],
)
async def test_maintenance_event_is_a_notice_until_none_resets_it(
    gcp: FakeGcpMetadata, value: str, notice_period: timedelta
) -> None:
    async with Collector(make(gcp.url)) as notices:
        await both_watches_hanging(gcp)
        gcp.set_maintenance(value)
        first = await notices.next(3)
        assert first.kind == "maintenance"
        assert first.detail["value"] == value
        assert first.deadline == first.noticed_at + notice_period
        gcp.set_maintenance("NONE")  # the event is over: nothing to say
        await wait_until(lambda: gcp.count(MAINTENANCE, status=200) >= 3, what="NONE read")
        await notices.expect_nothing(0.1)
        gcp.set_maintenance(value)  # a new event
        second = await notices.next(3)
        assert second.kind == "maintenance"
        assert second.id != first.id


async def test_notice_arrives_promptly(gcp: FakeGcpMetadata) -> None:
    async with Collector(make(gcp.url)) as notices:
        await both_watches_hanging(gcp)
        triggered = time.monotonic()
        gcp.preempt()
        await notices.next(3)
        latency = notices.received[0][0] - triggered
        assert latency < 1.0, f"notice took {latency:.3f} s"


# -- the protocol as GCP documents it ----------------------------------------------------


async def test_requests_carry_the_flavor_header_and_wait_with_last_etag(
    gcp: FakeGcpMetadata,
) -> None:
    async with Collector(make(gcp.url)) as notices:
        await wait_until(lambda: hanging(gcp, PREEMPTED) >= 2, what="two hanging GETs")
        await notices.expect_nothing(0)
    assert gcp.requests_without_flavor == 0
    reads = [r for r in gcp.requests if r.path == PREEMPTED]
    assert "wait_for_change" not in reads[0].query  # first the current value and ETag
    for later in reads[1:]:
        assert later.query["wait_for_change"] == "true"
        assert later.query["last_etag"] == etag_of("FALSE")
        assert later.query["timeout_sec"] == "1"


async def test_fake_refuses_requests_without_the_flavor_header(gcp: FakeGcpMetadata) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(gcp.url + PREEMPTED) as resp:
            assert resp.status == 403
        headers = {"Metadata-Flavor": "Google", "X-Forwarded-For": "10.0.0.1"}
        async with http.get(gcp.url + PREEMPTED, headers=headers) as resp:
            assert resp.status == 403
        async with http.get(gcp.url + PREEMPTED, headers={"Metadata-Flavor": "Google"}) as resp:
            assert resp.status == 200
            assert resp.headers["Metadata-Flavor"] == "Google"
            assert resp.headers["ETag"] == etag_of("FALSE")
            assert await resp.text() == "FALSE"


async def test_a_response_without_the_flavor_header_is_not_believed(
    gcp: FakeGcpMetadata,
) -> None:
    gcp.set_mode("impostor")  # 200 "TRUE", but not from the metadata server
    async with Collector(make(gcp.url)) as notices:
        await wait_until(lambda: gcp.count(PREEMPTED, status=200) >= 3, what="impostor answers")
        await notices.expect_nothing(0.2)
        gcp.set_mode("ok")
        gcp.preempt()
        assert (await notices.next(3)).kind == "preemption"


async def test_an_unexpected_value_is_ignored_and_the_next_change_seen_at_once(
    gcp: FakeGcpMetadata,
) -> None:
    gcp.set_value("preempted", "MAYBE")  # from the genuine server, but not TRUE or FALSE
    async with Collector(make(gcp.url, max_backoff=5.0)) as notices:
        await wait_until(lambda: hanging(gcp, PREEMPTED) >= 1, what="a hanging GET")
        await notices.expect_nothing(0.1)
        triggered = time.monotonic()
        gcp.preempt()
        await notices.next(3)
        assert notices.received[0][0] - triggered < 1.0  # no backoff in the way


async def test_503_during_maintenance_is_retried(gcp: FakeGcpMetadata) -> None:
    gcp.set_mode("503")
    async with Collector(make(gcp.url)) as notices:
        await wait_until(lambda: gcp.count(PREEMPTED, status=503) >= 3, what="503s")
        await notices.expect_nothing(0.1)
        gcp.set_mode("ok")
        gcp.preempt()
        assert (await notices.next(3)).kind == "preemption"


# -- bad responses ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["garbage", "wrong-shape", "500", "hang"])
async def test_bad_responses_raise_no_notice_and_the_watch_goes_on(
    gcp: FakeGcpMetadata, mode: str
) -> None:
    gcp.set_mode(mode)
    async with Collector(make(gcp.url)) as notices:
        await wait_until(lambda: gcp.count(PREEMPTED) >= (1 if mode == "hang" else 3))
        await notices.expect_nothing(0.3)
        gcp.set_mode("ok")
        gcp.preempt()
        assert (await notices.next(3)).kind == "preemption"


async def test_dead_endpoint_raises_nothing_and_recovers() -> None:
    port = free_port()
    ticks = 0

    async def counting_sleep(delay: float) -> None:
        nonlocal ticks
        ticks += 1
        await asyncio.sleep(delay)

    source = make(f"http://127.0.0.1:{port}", sleep=counting_sleep)
    async with Collector(source) as notices:
        await wait_until(lambda: ticks >= 6, what="retries against a closed port")
        await notices.expect_nothing(0.1)
        fake = FakeGcpMetadata()
        fake.preempt()
        await fake.start(port=port)
        try:
            assert (await notices.next(3)).kind == "preemption"
        finally:
            await fake.stop()


def test_fake_runs_in_a_background_thread() -> None:
    with FakeGcpMetadata() as gcp:
        gcp.set_maintenance("MIGRATE_ON_HOST_MAINTENANCE")

        async def first_notice() -> str:
            async with Collector(make(gcp.url)) as notices:
                return (await notices.next(3)).kind

        assert asyncio.run(first_notice()) == "maintenance"
