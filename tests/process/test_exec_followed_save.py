"""``ckptd exec`` on a node that follows another node's health save (docs/health.md, "What
each action does"): the save is acted on (the trainer signalled, emergency mode) and over
by itself, as on the node it began on; exec neither flushes nor exits, and its trainer is
not held. Another node's cloud notice still is a notice exec flushes for. The service is
built for real on a directory store; its trainer is never started."""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptd.notices.cluster import notice_document
from ckptd.notices.model import Notice
from ckptd.repository import Repository
from ckptd.supervision.restarts import RestartPolicy


def exec_follower(tmp_path: Path) -> Any:
    from ckptd.config import load_settings
    from ckptd.supervision.exec_service import SupervisedService

    watch = tmp_path / "watch"
    watch.mkdir()
    settings = load_settings(
        overrides={
            "watch": [{"dir": str(watch), "run_id": "run"}],
            "destination": {"url": f"file://{tmp_path / 'store'}"},
            "state": {"dir": str(tmp_path / "state")},
            "cluster": {"nodes": 2, "node_rank": 1, "poll_interval_seconds": 0.05},
        },
        environ={},
    )
    return SupervisedService(settings, [sys.executable, "-c", "pass"], policy=RestartPolicy())


async def follow(service: Any, kind: str, seconds: float) -> Notice:
    """Another node's notice of ``kind``, published to the store and polled here."""
    at = service.started_at + timedelta(milliseconds=5)
    notice = Notice(
        source="health" if kind == "health-save" else "aws",
        kind=kind,
        id=f"{kind}:1",
        noticed_at=at,
        deadline=at + timedelta(seconds=seconds),
    )
    Repository(service.storage).write_notice(
        "run", notice_document(notice, node_rank=0, host="peer")
    )
    (followed,) = await service.cluster_source.poll_once()
    assert followed.kind == kind
    await service._on_notice(followed, service.cluster_source)
    return followed  # type: ignore[no-any-return]


async def test_a_followed_health_save_is_saved_for_and_exec_goes_on(tmp_path: Path) -> None:
    service = exec_follower(tmp_path)
    followed = await follow(service, "health-save", seconds=1.0)
    response = service.responder.current
    assert response is not None and response.notice.id == followed.id
    assert followed.source == "node-0/health"
    assert not service.noticed.is_set(), "exec would flush and exit"
    assert not service.responding
    assert service.supervisor.status()["held"] is False
    # Over by itself: emergency mode left at its commit, here at its deadline.
    loop = asyncio.get_running_loop()
    ends = loop.time() + 30
    while service.responder.current is not None and loop.time() < ends:
        await asyncio.sleep(0.05)
    assert service.responder.current is None
    await service.responder.settle()
    await service.publisher.drain(1)


async def test_a_followed_cloud_notice_still_makes_exec_flush(tmp_path: Path) -> None:
    service = exec_follower(tmp_path)
    await follow(service, "spot-termination", seconds=120.0)
    assert service.noticed.is_set() and service.responding
    assert service.supervisor.status()["held"] is True
    await service.responder.settle()
    await service.publisher.drain(1)
