"""A checkpoint's commit record starts its shipping (and, during a notice, its push to
peers) with no debounce: the record is the save's last write, so there is no burst left
to coalesce (``ckptd.sync.looks``, ``ckptd.sync.watcher``).

The other file events are given a debounce of 30 s here (and their burst no cap): a push
that starts within the test's deadline was started by the record, not by a timer.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptd.config import load_settings
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_storage
from ckptd.sync.hooks import PipelineHooks
from ckptd.sync.journal import Journal
from ckptd.sync.looks import LOOK_SPACING, Looks
from ckptd.sync.pipeline import SyncPipeline
from ckptd.sync.runs import RunState
from ckptd.sync.watcher import Watcher
from tests.support.fakes import wait_until

LONG_DEBOUNCE = 30.0


def dcp_settings(tmp_path: Path) -> Any:
    watch, store, state = tmp_path / "watch", tmp_path / "store", tmp_path / "state"
    for d in (watch, store, state):
        d.mkdir()
    return load_settings(
        overrides={
            "watch": [{"dir": str(watch), "run_id": "run", "layout": "dcp"}],
            "destination": {"url": f"file://{store}", "concurrency": 1},
            "state": {"dir": str(state)},
            "retention": {"keep_last": 0},
        },
        environ={},
    )


async def test_during_a_notice_the_push_starts_when_the_commit_record_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ckptd.sync.looks.EVENT_MAX_DELAY_SECONDS", 2 * LONG_DEBOUNCE)
    claimed: list[tuple[float, str, bool]] = []

    def on_claimed(request: Any, emergency: bool, left: float | None) -> None:
        claimed.append((time.monotonic(), request.name, emergency))

    settings = dcp_settings(tmp_path)
    journal = Journal(settings.state.dir)
    pipeline = SyncPipeline(
        settings,
        open_storage(settings.destination.url, concurrency=1),
        journal,
        Metrics(),
        hooks=PipelineHooks(on_claimed=on_claimed),
    )
    watch = settings.watch[0].dir
    watcher = Watcher(
        {"run": watch},
        lambda run, name: pipeline.hint(run, name, LONG_DEBOUNCE),
        pipeline.record_seen,
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(pipeline.work(stop))
    watcher.start(asyncio.get_running_loop())
    try:
        pipeline.emergency.enter_emergency(datetime.now(UTC) + timedelta(seconds=60))
        ckpt = watch / "step-10"
        ckpt.mkdir()
        (ckpt / "__0_0.distcp").write_bytes(os.urandom(256 * 1024))
        (ckpt / ".metadata.tmp").write_bytes(b"meta")
        await asyncio.sleep(0.3)  # the shards' events are in (and wait 30 s)
        assert not claimed and pipeline.looks.busy()
        os.rename(ckpt / ".metadata.tmp", ckpt / ".metadata")  # DCP's commit record
        recorded = time.monotonic()
        await wait_until(lambda: bool(claimed), timeout=LONG_DEBOUNCE / 2, what="the push")
    finally:
        watcher.stop()
        stop.set()
        await asyncio.wait_for(worker, 30)
        await pipeline.close()
        journal.close()
    at, name, emergency = claimed[0]
    assert (name, emergency) == ("step-10", True)
    # Well inside the debounce the other events got; the figure itself is for the log
    # (on an idle machine a few ms: the look, the claim).
    print(f"commit record -> push started: {at - recorded:.3f} s")
    assert at - recorded < LONG_DEBOUNCE / 2


async def test_a_record_during_a_look_is_looked_at_right_after_it_unspaced(
    tmp_path: Path,
) -> None:
    settings = dcp_settings(tmp_path)
    runs = {"run": RunState.of(settings.watch[0])}
    started: list[float] = []
    ended: list[float] = []
    first_look = 1.5  # spacing would hold the next look LOOK_SPACING x this after it

    async def look(run: str, name: str) -> None:
        started.append(asyncio.get_running_loop().time())
        if len(started) == 1:
            await asyncio.sleep(first_look)
        ended.append(asyncio.get_running_loop().time())

    looks = Looks(runs, look, tier_metrics=Metrics(), log=_NoLog())
    try:
        looks.record_seen("run", "step-10")
        await wait_until(lambda: bool(started), timeout=10, what="the first look")
        looks.record_seen("run", "step-10")  # the record again, while the look runs
        looks.hint("run", "step-10", LONG_DEBOUNCE)  # a plain event: would wait 30 s
        await wait_until(lambda: len(started) == 2, timeout=10, what="the look after")
    finally:
        looks.close()
    # Started after the first ended, and with no spacing (3 s here) nor debounce.
    assert ended[0] <= started[1] < ended[0] + LOOK_SPACING * first_look


class _NoLog:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None
