"""The cluster's NOTICE in process: which NOTICE a node follows (pure), the object in a
real store (SeaweedFS and a directory), the follower's poll, and the publisher's retries
against a store that refuses the write (a fault proxy in front of SeaweedFS)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3
from ckptd.notices.cluster import (
    ClusterNoticeSource,
    NoticePublisher,
    judge_notice,
    notice_document,
)
from ckptd.notices.model import Notice, format_time
from ckptd.repository import NOTICE_FORMAT, Repository, notice_key
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_storage
from ckptd.storage.base import Storage
from tests.support.faultproxy import FaultProxy

START = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def doc(
    *,
    rank: int = 0,
    noticed_at: datetime = START + timedelta(seconds=5),
    deadline: datetime | None = START + timedelta(minutes=2),
    **extra: Any,
) -> dict[str, Any]:
    return {
        "format": NOTICE_FORMAT,
        "source": "aws",
        "kind": "spot-termination",
        "deadline": format_time(deadline) if deadline else None,
        "noticed_at": format_time(noticed_at),
        "node_rank": rank,
        "host": "node-a",
        "id": "aws:terminate:x",
        **extra,
    }


def own_notice(
    source: str = "aws", *, deadline_s: float | None = 120.0, at: datetime | None = None
) -> Notice:
    now = at or datetime.now(UTC)
    return Notice(
        source=source,
        kind="spot-termination",
        id=f"{source}:{now.isoformat()}",
        noticed_at=now,
        deadline=now + timedelta(seconds=deadline_s) if deadline_s is not None else None,
    )


# -- which NOTICE to follow (pure) ----------------------------------------------------------


def test_another_nodes_fresh_notice_is_followed_as_from_that_node() -> None:
    now = START + timedelta(seconds=10)
    judged = judge_notice(doc(rank=3), own_rank=1, started_at=START, now=now)
    notice = judged.notice
    assert notice is not None, judged.reason
    assert notice.source == "node-3/aws"
    assert notice.kind == "spot-termination"
    assert notice.deadline == START + timedelta(minutes=2)
    assert notice.noticed_at == START + timedelta(seconds=5)
    assert notice.detail["node_rank"] == 3 and notice.detail["host"] == "node-a"
    # The same NOTICE read again is the same notice (the dedupe key).
    again = judge_notice(doc(rank=3), own_rank=1, started_at=START, now=now).notice
    assert again is not None and again.id == notice.id


def test_a_notice_without_deadline_is_followed_while_fresh() -> None:
    judged = judge_notice(doc(deadline=None), own_rank=1, started_at=START, now=START)
    assert judged.notice is not None and judged.notice.deadline is None


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        (doc(rank=1), "own"),
        (doc(noticed_at=START - timedelta(seconds=1)), "stale: noticed before"),
        (doc(noticed_at=START), "stale: noticed before"),
        (doc(deadline=START + timedelta(seconds=9)), "stale: deadline past"),
        (doc(node_rank="0"), "malformed"),
        (doc(node_rank=-1), "malformed"),
        ({**doc(), "noticed_at": "yesterday"}, "malformed"),
        ({k: v for k, v in doc().items() if k != "kind"}, "malformed"),
    ],
)
def test_own_stale_and_malformed_notices_are_not_followed(
    document: dict[str, Any], reason: str
) -> None:
    judged = judge_notice(document, own_rank=1, started_at=START, now=START + timedelta(seconds=10))
    assert judged.notice is None
    assert judged.reason.startswith(reason)


def test_the_document_carries_the_protocol_fields() -> None:
    notice = own_notice()
    body = notice_document(notice, node_rank=2, host="h")
    assert set(body) >= {"source", "kind", "deadline", "noticed_at", "node_rank", "host"}
    judged = judge_notice(
        body, own_rank=0, started_at=notice.noticed_at - timedelta(seconds=1), now=notice.noticed_at
    )
    assert judged.notice is not None and judged.notice.source == "node-2/aws"


# -- the object in a real store --------------------------------------------------------------


def test_notice_round_trips_and_is_never_a_checkpoint(storage: Storage) -> None:
    repo = Repository(storage)
    assert repo.read_notice("run") is None
    repo.write_notice("run", doc(rank=4))
    read = repo.read_notice("run")
    assert read is not None and read["node_rank"] == 4 and read["format"] == NOTICE_FORMAT
    # A run-level object: not a checkpoint name, not a committed checkpoint.
    assert repo.list_names("run") == []
    assert repo.list_committed("run") == []
    # Overwritten by the next notice.
    repo.write_notice("run", doc(rank=5))
    assert (repo.read_notice("run") or {})["node_rank"] == 5


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", json.dumps({"format": "other/1"}).encode(), b"{" * 70_000],
)
def test_garbage_under_the_notice_key_is_no_notice(storage: Storage, body: bytes) -> None:
    from ckptd.core import checksum

    storage.put_bytes(notice_key("run"), body, crc32c=checksum.crc32c(body))
    assert Repository(storage).read_notice("run") is None


# -- following --------------------------------------------------------------------------------


async def test_the_follower_yields_each_notice_once_and_never_its_own(storage: Storage) -> None:
    repo = Repository(storage)
    metrics = Metrics()
    started = datetime.now(UTC)
    source = ClusterNoticeSource(
        repo,
        ["run", "other"],
        own_rank=1,
        started_at=started,
        interval=0.05,
        metrics=metrics,
    )
    assert await source.poll_once() == []
    # A previous cluster's notice (before this daemon started) is ignored.
    repo.write_notice("run", doc(rank=0, noticed_at=started - timedelta(minutes=5)))
    assert await source.poll_once() == []
    # Its own notice (this node published it) is never followed.
    fresh = own_notice(at=started + timedelta(milliseconds=5))  # times have ms precision
    repo.write_notice("run", notice_document(fresh, node_rank=1, host="me"))
    assert await source.poll_once() == []
    # Another node's: followed once, though both runs carry it and the poll repeats.
    repo.write_notice("run", notice_document(fresh, node_rank=0, host="peer"))
    repo.write_notice("other", notice_document(fresh, node_rank=0, host="peer"))
    found = await source.poll_once()
    assert [n.source for n in found] == ["node-0/aws"]
    assert await source.poll_once() == []
    followed = metrics.cluster_notices.labels(run="run", event="followed")._value.get()
    assert followed == 1


async def test_the_follower_keeps_polling_through_a_store_outage(
    local_s3: LocalS3, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    storage = open_storage(s3_dest, endpoint_url=fault_proxy.url, max_attempts=1)
    repo = Repository(storage)
    started = datetime.now(UTC)
    source = ClusterNoticeSource(repo, ["run"], own_rank=1, started_at=started, interval=0.05)
    fault_proxy.deny("503-unavailable", methods={"GET"})
    assert await source.poll_once() == []  # logged, not raised
    fault_proxy.clear_faults()
    later = own_notice(at=started + timedelta(milliseconds=5))
    repo.write_notice("run", notice_document(later, node_rank=0, host="peer"))
    notices: list[Notice] = []

    async def collect() -> None:
        async for notice in source.watch():
            notices.append(notice)
            return

    await asyncio.wait_for(collect(), timeout=10)
    assert notices[0].source == "node-0/aws"


# -- publishing ------------------------------------------------------------------------------


async def test_a_refused_publish_is_retried_until_written(
    local_s3: LocalS3, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    storage = open_storage(s3_dest, endpoint_url=fault_proxy.url, max_attempts=1)
    repo = Repository(storage)
    metrics = Metrics()
    publisher = NoticePublisher(
        repo, ["run"], node_rank=0, host="me", retry_seconds=0.05, metrics=metrics
    )
    fault_proxy.deny("503-slowdown", methods={"PUT"})
    notice = own_notice()
    task = publisher.publish(notice)
    failed = metrics.cluster_notices.labels(run="run", event="publish_failed")
    for _ in range(200):
        if failed._value.get() >= 2:
            break
        await asyncio.sleep(0.05)
    assert failed._value.get() >= 2, "the refused write was not retried"
    assert not task.done()
    fault_proxy.clear_faults()
    assert await asyncio.wait_for(task, timeout=10) is True
    written = repo.read_notice("run")
    assert written is not None
    assert (written["node_rank"], written["source"], written["id"]) == (0, "aws", notice.id)
    assert metrics.cluster_notices.labels(run="run", event="published")._value.get() == 1


async def test_publishing_gives_up_at_the_deadline(
    local_s3: LocalS3, s3_dest: str, fault_proxy: FaultProxy
) -> None:
    storage = open_storage(s3_dest, endpoint_url=fault_proxy.url, max_attempts=1)
    publisher = NoticePublisher(
        Repository(storage), ["run"], node_rank=0, host="me", retry_seconds=0.05
    )
    fault_proxy.deny("500", methods={"PUT"})
    task = publisher.publish(own_notice(deadline_s=0.5))
    assert await asyncio.wait_for(task, timeout=10) is False


class StubEmergency:
    """The responder's view of the pipeline (watch dirs, emergency switch), recorded."""

    def __init__(self, watch: Path) -> None:
        self.watch = watch
        self.deadlines: list[datetime | None] = []
        self.since: list[float | None] = []

    def watch_dirs(self) -> list[Path]:
        return [self.watch]

    def enter_emergency(self, deadline: datetime | None, since: float | None = None) -> None:
        self.deadlines.append(deadline)
        self.since.append(since)

    def move_deadline(self, deadline: datetime | None) -> None:
        self.deadlines.append(deadline)

    def leave_emergency(self) -> None:
        pass


async def test_a_followed_notice_counts_the_emergency_from_its_origin_and_an_own_one_from_now(
    tmp_path: Path,
) -> None:
    """The trainer may save on another node's notice before this daemon hears of it
    through the store: that save must count as the emergency checkpoint, so emergency mode
    starts at the origin's ``noticed_at``. A notice of this node's own starts it now."""
    from ckptd.config import load_settings
    from ckptd.notices.responder import Responder

    watch = tmp_path / "watch"
    watch.mkdir()
    settings = load_settings(
        overrides={
            "watch": [{"dir": str(watch), "run_id": "run"}],
            "destination": {"url": f"file://{tmp_path / 'store'}"},
            "cluster": {"nodes": 2, "node_rank": 0},
        },
        environ={},
    )
    pipeline = StubEmergency(watch)
    responder = Responder(settings, Metrics(), pipeline)
    began = datetime.now(UTC) - timedelta(seconds=2)
    followed = judge_notice(
        {
            "node_rank": 1,
            "source": "aws",
            "kind": "spot-termination",
            "noticed_at": format_time(began),
            "deadline": format_time(began + timedelta(seconds=120)),
        },
        own_rank=0,
        started_at=began - timedelta(seconds=60),
        now=datetime.now(UTC),
    ).notice
    assert followed is not None
    await responder.handle(followed, publish=False)
    assert pipeline.since == [pytest.approx(began.timestamp(), abs=0.001)]
    responder.current = None
    await responder.handle(own_notice())
    assert pipeline.since[1:] == [None]


async def test_the_trainer_is_signalled_while_the_store_still_hangs_on_the_notice(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """Publishing never delays the trainer's signal: the NOTICE write hangs (a proxy that
    never answers the PUT) while the real trainer process has its signal already."""
    import subprocess
    import sys

    from ckptd.config import load_settings
    from ckptd.notices.responder import Responder
    from tests.support.daemon import wait_until

    pidfile, record = tmp_path / "trainer.pid", tmp_path / "signals"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.trainers.signal_recorder",
            *("--pidfile", str(pidfile), "--record", str(record), "--max-seconds", "60"),
        ],
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_until(pidfile.exists, 30, "trainer started")
        watch = tmp_path / "watch"
        watch.mkdir()
        settings = load_settings(
            overrides={
                "watch": [{"dir": str(watch), "run_id": "run"}],
                "destination": {"url": s3_dest},
                "trainer": {"pidfile": str(pidfile)},
                "cluster": {"nodes": 2, "node_rank": 0},
            },
            environ={},
        )
        with FaultProxy(local_s3.endpoint_url, stall_seconds=3) as proxy:
            proxy.deny("timeout", methods={"PUT"})
            storage = open_storage(s3_dest, endpoint_url=proxy.url, max_attempts=1)
            publisher = NoticePublisher(
                Repository(storage), ["run"], node_rank=0, host="me", retry_seconds=0.05
            )
            responder = Responder(settings, Metrics(), StubEmergency(watch))
            responder.publish_notice = publisher.publish
            notice = own_notice()
            response = await asyncio.wait_for(responder.handle(notice), timeout=5)
            assert response is not None and response.pids == [trainer.pid]
            wait_until(record.exists, 5, "the trainer's signal")
            assert response.published is not None and not response.published.done()
            assert response.timings(datetime.now(UTC))["notice_published"] is False
            # Once the store answers again, the NOTICE is written after all.
            proxy.clear_faults()
            await publisher.drain(30)
            assert response.published.done() and response.published.result() is True
            assert response.timings(datetime.now(UTC))["notice_published"] is True
    finally:
        trainer.kill()
        trainer.wait()


# -- the service's notice loop -----------------------------------------------------------------


class CloudStandIn:
    """A notice source object as the service's loop hands it over (no I/O)."""

    name = "aws"

    def watch(self) -> Any:
        raise NotImplementedError

    async def acknowledge(self, notice: Notice) -> None:
        pass


def cluster_service(tmp_path: Path, storage_url: str) -> Any:
    from ckptd.config import load_settings
    from ckptd.daemon.service import Service

    watch = tmp_path / "watch"
    watch.mkdir()
    settings = load_settings(
        overrides={
            "watch": [{"dir": str(watch), "run_id": "run"}],
            "destination": {"url": storage_url},
            "state": {"dir": str(tmp_path / "state")},
            "cluster": {"nodes": 2, "node_rank": 1, "poll_interval_seconds": 0.05},
        },
        environ={},
    )
    return Service(settings)


async def test_a_followed_notice_is_acted_on_and_never_published_again(tmp_path: Path) -> None:
    service = cluster_service(tmp_path, f"file://{tmp_path / 'store'}")
    assert service.cluster_source is not None and service.publisher is not None
    # Noticed on the peer a moment after this daemon started (times have ms precision).
    later = service.started_at + timedelta(milliseconds=5)
    peer = notice_document(own_notice(at=later), node_rank=0, host="peer")
    Repository(service.storage).write_notice("run", peer)
    (followed,) = await service.cluster_source.poll_once()
    await service._on_notice(followed, service.cluster_source)
    response = service.responder.current
    assert response is not None and response.notice.source == "node-0/aws"
    assert response.published is None  # not handed to the publisher
    assert (Repository(service.storage).read_notice("run") or {})["node_rank"] == 0
    assert service.status()["preemption"]["source"] == "node-0/aws"
    await service.publisher.drain(1)


async def test_own_notice_is_published_and_a_later_followed_one_does_not_replace_it(
    tmp_path: Path,
) -> None:
    service = cluster_service(tmp_path, f"file://{tmp_path / 'store'}")
    assert service.cluster_source is not None and service.publisher is not None
    mine = own_notice()
    await service._on_notice(mine, CloudStandIn())
    response = service.responder.current
    assert response is not None and response.published is not None
    assert await asyncio.wait_for(response.published, 10) is True
    written = Repository(service.storage).read_notice("run")
    assert written is not None and (written["node_rank"], written["id"]) == (1, mine.id)
    # Another node, preempted at the same moment, publishes too; we are responding already.
    later = service.started_at + timedelta(milliseconds=5)
    Repository(service.storage).write_notice(
        "run", notice_document(own_notice(at=later), node_rank=0, host="peer")
    )
    (followed,) = await service.cluster_source.poll_once()
    await service._on_notice(followed, service.cluster_source)
    assert service.responder.current is response
    await service.publisher.drain(1)
