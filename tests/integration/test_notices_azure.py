"""Azure Scheduled Events notice source against a loopback fake of IMDS (real time)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest

from ckptd.notices.azure import AzureScheduledEventsSource
from tests.support.fakes import Collector, free_port, wait_until
from tests.support.fakes.azure_metadata import FakeAzureMetadata

EVENTS = "/metadata/scheduledevents"
NAME = "/metadata/instance/compute/name"


@pytest.fixture
async def azure() -> AsyncIterator[FakeAzureMetadata]:
    async with FakeAzureMetadata() as fake:
        yield fake


def make(endpoint: str, **kw: Any) -> AzureScheduledEventsSource:
    kw.setdefault("request_timeout", 0.3)
    kw.setdefault("first_request_timeout", 1.0)
    return AzureScheduledEventsSource(endpoint, poll_interval=0.05, **kw)


async def polls_seen(fake: FakeAzureMetadata, n: int, **kw: Any) -> None:
    since = time.monotonic()
    await wait_until(
        lambda: fake.count(EVENTS, method="GET", since=since, **kw) >= n, what=f"{n} polls"
    )


# -- notices ---------------------------------------------------------------------------


async def test_no_events_yields_nothing(azure: FakeAzureMetadata) -> None:
    async with Collector(make(azure.url)) as notices:
        await polls_seen(azure, 3, status=200)
        await notices.expect_nothing(0.3)


async def test_preempt_is_yielded_once_with_not_before_as_deadline(
    azure: FakeAzureMetadata,
) -> None:
    not_before = (datetime.now(UTC) + timedelta(seconds=30)).replace(microsecond=0)
    async with Collector(make(azure.url)) as notices:
        event_id = azure.add_event("Preempt", not_before=not_before)
        notice = await notices.next(3)
        assert (notice.source, notice.kind, notice.id) == ("azure", "preemption", event_id)
        assert notice.deadline == not_before
        assert not notice.cancelled
        assert notice.detail["event_status"] == "Scheduled"
        await polls_seen(azure, 5, status=200)
        await notices.expect_nothing(0.1)


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("Preempt", "preemption"),
        ("Terminate", "terminate"),
        ("Reboot", "reboot"),
        ("Redeploy", "redeploy"),
        ("Freeze", "freeze"),
    ],
)
async def test_event_types_map_to_kinds(
    azure: FakeAzureMetadata, event_type: str, kind: str
) -> None:
    azure.add_event(event_type)
    async with Collector(make(azure.url)) as notices:
        assert (await notices.next(3)).kind == kind


async def test_started_event_has_no_deadline(azure: FakeAzureMetadata) -> None:
    azure.add_event("Reboot", not_before="", status="Started")
    async with Collector(make(azure.url)) as notices:
        notice = await notices.next(3)
        assert notice.deadline is None
        assert notice.detail["event_status"] == "Started"


async def test_only_events_for_this_vm_count(azure: FakeAzureMetadata) -> None:
    azure.add_event("Reboot", resources=["other-vm"])
    ours = azure.add_event("Freeze", resources=["other-vm", "CKPTD-TEST-VM"])
    async with Collector(make(azure.url)) as notices:
        assert (await notices.next(3)).id == ours
        await polls_seen(azure, 3, status=200)
        await notices.expect_nothing(0.1)
    lookups = [r for r in azure.requests if r.path == NAME]
    assert len(lookups) == 1
    assert lookups[0].query == {"api-version": "2021-02-01", "format": "text"}
    assert lookups[0].header("Metadata") == "true"


async def test_unknown_vm_name_takes_every_event_as_ours() -> None:
    async with FakeAzureMetadata(vm_name=None) as azure:
        event_id = azure.add_event("Preempt", resources=["someone-else"])
        async with Collector(make(azure.url)) as notices:
            assert (await notices.next(3)).id == event_id
        assert azure.count(NAME, status=404) >= 1


async def test_a_given_vm_name_needs_no_lookup(azure: FakeAzureMetadata) -> None:
    azure.add_event("Preempt", resources=["vm-7"])
    async with Collector(make(azure.url, vm_name="vm-7")) as notices:
        await notices.next(3)
    assert azure.count(NAME) == 0


async def test_removed_event_yields_a_cancelled_notice(azure: FakeAzureMetadata) -> None:
    async with Collector(make(azure.url)) as notices:
        event_id = azure.add_event("Redeploy")
        first = await notices.next(3)
        azure.remove_event(event_id)
        gone = await notices.next(3)
        assert (gone.id, gone.kind, gone.cancelled) == (event_id, first.kind, True)
        assert gone.deadline is None
        await polls_seen(azure, 3, status=200)
        await notices.expect_nothing(0.1)


async def test_acknowledge_posts_start_requests_for_the_event(azure: FakeAzureMetadata) -> None:
    source = make(azure.url)
    async with Collector(source) as notices:
        event_id = azure.add_event("Preempt")
        notice = await notices.next(3)
        await source.acknowledge(notice)
        assert azure.acks == [event_id]
        (post,) = [r for r in azure.requests if r.method == "POST"]
        assert post.query == {"api-version": "2020-07-01"}
        assert post.header("Metadata") == "true"
        assert json.loads(post.body) == {"StartRequests": [{"EventId": event_id}]}
        # The event has now started: same EventId, so no second notice.
        await polls_seen(azure, 3, status=200)
        await notices.expect_nothing(0.1)


async def test_acknowledge_outside_watch_and_of_cancelled_notices(
    azure: FakeAzureMetadata,
) -> None:
    event_id = azure.add_event("Terminate")
    source = make(azure.url)
    async with Collector(source) as notices:
        notice = await notices.next(3)
    await source.acknowledge(notice)  # the watch has ended: a session of its own
    assert azure.acks == [event_id]
    await source.acknowledge(dataclasses.replace(notice, cancelled=True))
    assert azure.acks == [event_id]


async def test_notice_arrives_within_one_poll_interval(azure: FakeAzureMetadata) -> None:
    async with Collector(make(azure.url)) as notices:
        await polls_seen(azure, 2, status=200)
        triggered = time.monotonic()
        azure.add_event("Preempt")
        await notices.next(3)
        latency = notices.received[0][0] - triggered
        assert latency < 1.0, f"notice took {latency:.3f} s with 0.05 s polls"


async def test_slow_first_call_is_waited_for() -> None:
    async with FakeAzureMetadata(first_call_delay=0.5) as azure:
        azure.add_event("Preempt")
        source = make(azure.url, request_timeout=0.1, first_request_timeout=3.0)
        async with Collector(source) as notices:
            assert (await notices.next(3)).kind == "preemption"


# -- bad responses ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["garbage", "wrong-shape", "500", "410", "429", "hang"])
async def test_bad_responses_raise_no_notice_and_the_watch_goes_on(
    azure: FakeAzureMetadata, mode: str
) -> None:
    azure.set_mode(mode)
    async with Collector(make(azure.url, vm_name="ckptd-test-vm")) as notices:
        await polls_seen(azure, 2 if mode == "hang" else 4)
        await notices.expect_nothing(0.2)
        azure.set_mode("ok")
        azure.add_event("Preempt")
        assert (await notices.next(3)).kind == "preemption"


async def test_bad_responses_do_not_cancel_known_events(azure: FakeAzureMetadata) -> None:
    azure.add_event("Preempt")
    async with Collector(make(azure.url)) as notices:
        await notices.next(3)
        for mode in ("garbage", "wrong-shape", "500"):
            azure.set_mode(mode)
            await polls_seen(azure, 3)
        azure.set_mode("ok")
        await polls_seen(azure, 3, status=200)
        await notices.expect_nothing(0.1)


async def test_dead_endpoint_raises_nothing_and_recovers() -> None:
    port = free_port()
    ticks = 0

    async def counting_sleep(delay: float) -> None:
        nonlocal ticks
        ticks += 1
        await asyncio.sleep(delay)

    source = make(f"http://127.0.0.1:{port}", sleep=counting_sleep)
    async with Collector(source) as notices:
        await wait_until(lambda: ticks >= 5, what="polls against a closed port")
        await notices.expect_nothing(0.1)
        fake = FakeAzureMetadata()
        fake.add_event("Preempt")
        await fake.start(port=port)
        try:
            assert (await notices.next(3)).kind == "preemption"
        finally:
            await fake.stop()


# -- the fake is faithful to IMDS ------------------------------------------------------


async def test_fake_imds_enforces_the_documented_rules(azure: FakeAzureMetadata) -> None:
    url = azure.url + EVENTS
    ok = {"Metadata": "true"}
    version = {"api-version": "2020-07-01"}
    async with aiohttp.ClientSession() as http:

        async def status(method: str, path: str, **kw: Any) -> int:
            async with http.request(method, azure.url + path, **kw) as resp:
                return resp.status

        assert await status("GET", EVENTS, params=version) == 400  # no Metadata header
        assert await status("GET", EVENTS, headers=ok) == 400  # no api-version
        xff = {**ok, "X-Forwarded-For": "10.0.0.1"}
        assert await status("GET", EVENTS, params=version, headers=xff) == 400
        name = {"api-version": "2021-02-01"}
        assert await status("GET", NAME, params=name, headers=ok) == 400  # leaf needs format=text
        assert await status("POST", EVENTS, params=version, headers=ok, data="{}") == 400
        unknown = json.dumps({"StartRequests": [{"EventId": "nope"}]})
        assert await status("POST", EVENTS, params=version, headers=ok, data=unknown) == 400
        async with http.get(url, params=version, headers=ok) as resp:
            assert resp.status == 200
            assert await resp.json() == {"DocumentIncarnation": 1, "Events": []}


def test_fake_runs_in_a_background_thread() -> None:
    with FakeAzureMetadata() as azure:
        azure.add_event("Terminate")

        async def first_notice() -> str:
            async with Collector(make(azure.url)) as notices:
                return (await notices.next(3)).kind

        assert asyncio.run(first_notice()) == "terminate"
