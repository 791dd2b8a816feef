"""The pipeline in-process, on a real directory as the store: an older upload in flight
is paused for an emergency checkpoint, which commits first; the older one then resumes
from its journalled parts and commits too. Also: the outcome of each kind of failure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ckptd.config import load_settings
from ckptd.repository import Repository
from ckptd.runtime.metrics import FAILURE_REASONS, STORAGE_ERROR_KINDS, Metrics
from ckptd.storage import open_storage
from ckptd.sync.hooks import PipelineHooks
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline
from tests.support.fakes import wait_until

MiB = 1024 * 1024
PART = 5 * MiB


def write_marked(root: Path, name: str, size: int) -> Path:
    ckpt = root / name
    ckpt.mkdir(parents=True)
    with open(ckpt / "weights.bin", "wb") as fh:
        fh.write(os.urandom(size))
    (ckpt / "COMPLETE").write_text("")
    return ckpt


def written_well_before(ckpt: Path) -> Path:
    """``ckpt``'s files dated 30 s back: written well before a notice sent now (one written
    within ``EMERGENCY_MTIME_SLACK`` of it would count as its save)."""
    past = time.time() - 30
    for f in ckpt.iterdir():
        os.utime(f, (past, past))
    return ckpt


def sent_bytes(pipeline: SyncPipeline) -> float:
    value = pipeline.metrics.registry.get_sample_value("ckptd_upload_bytes_total", {"run": "run"})
    return value or 0.0


def record_commits() -> tuple[list[tuple[str, bool]], PipelineHooks]:
    """(checkpoint, emergency) of each commit, in order, as a pipeline built with the
    returned hooks reports them."""
    order: list[tuple[str, bool]] = []

    async def on_commit(run: str, name: str, nbytes: int, emergency: bool) -> None:
        order.append((name, emergency))

    return order, PipelineHooks(on_commit=on_commit)


async def ship_until_a_part_is_sent(pipeline: SyncPipeline, name: str) -> None:
    """Queue ``name`` (complete) and return once its upload has sent a whole part."""
    await pipeline.evaluate("run", name)
    state = pipeline.runs["run"]
    await wait_until(
        lambda: state.current is not None and state.current.sent_bytes >= PART,
        timeout=30,
        what=f"{name}'s upload under way",
    )


@contextlib.asynccontextmanager
async def running(pipeline: SyncPipeline, journal: Journal) -> AsyncIterator[asyncio.Task[None]]:
    """The pipeline's worker through the block (yielded); then the worker stopped, the
    pipeline and its journal closed."""
    stop = asyncio.Event()
    worker = asyncio.create_task(pipeline.work(stop))
    try:
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
        await pipeline.close()
        journal.close()


def make_pipeline(
    tmp_path: Path, *, mib_per_s: float, hooks: PipelineHooks | None = None
) -> tuple[SyncPipeline, Journal, Path]:
    watch, store, state = tmp_path / "watch", tmp_path / "store", tmp_path / "state"
    for d in (watch, store, state):
        d.mkdir()
    settings = load_settings(
        overrides={
            "watch": [{"dir": str(watch), "run_id": "run", "layout": "marker"}],
            "destination": {"url": f"file://{store}", "part_size_mib": 5, "concurrency": 1},
            "state": {"dir": str(state)},
            "retention": {"keep_last": 0},
        },
        environ={},
    )
    storage = open_storage(
        settings.destination.url, concurrency=1, max_upload_bytes_per_s=mib_per_s * MiB
    )
    journal = Journal(state)
    return SyncPipeline(settings, storage, journal, Metrics(), hooks=hooks), journal, watch


async def test_emergency_checkpoint_pauses_an_older_upload_commits_first_and_the_older_resumes(
    tmp_path: Path,
) -> None:
    # 8 MiB/s: the 40 MiB older checkpoint takes ~5 s, so it is mid-upload when the
    # notice comes, and with a 1 s deadline both cannot finish: it must make way.
    order, hooks = record_commits()
    pipeline, journal, watch = make_pipeline(tmp_path, mib_per_s=8, hooks=hooks)
    async with running(pipeline, journal):
        older = written_well_before(write_marked(watch, "ck-1", 8 * PART))
        await ship_until_a_part_is_sent(pipeline, "ck-1")
        pipeline.emergency.enter_emergency(datetime.now(UTC) + timedelta(seconds=1))
        write_marked(watch, "ck-2", MiB)
        await pipeline.evaluate("run", "ck-2")
        assert pipeline.queue.get("run", "ck-2").emergency  # type: ignore[union-attr]
        assert not pipeline.queue.get("run", "ck-1").emergency  # type: ignore[union-attr]
        await wait_until(lambda: len(order) == 2, timeout=60, what="both committed")

    assert order == [("ck-2", True), ("ck-1", False)]
    repo = pipeline.repo
    assert [c.manifest.checkpoint for c in Repository(repo.storage).list_committed("run")] == [
        "ck-1",
        "ck-2",
    ]
    # The older upload resumed: its finished parts were not sent again. At most the part
    # that was in flight when it paused goes twice.
    sent = sent_bytes(pipeline)
    total = 8 * PART + MiB
    assert total <= sent <= total + PART
    assert (older / "weights.bin").stat().st_size == 8 * PART


async def test_a_checkpoint_queued_just_before_the_notice_is_promoted_and_goes_first(
    tmp_path: Path,
) -> None:
    """Many nodes: the trainer saved on another node's notice, which reached this daemon a
    moment after the save was queued behind an older upload. The notice's second look at
    it makes it the emergency checkpoint: it commits before the older one (seen in the
    fleet campaign, #48: the save waited 3 s behind a periodic checkpoint and missed the
    deadline)."""
    order, hooks = record_commits()
    pipeline, journal, watch = make_pipeline(tmp_path, mib_per_s=8, hooks=hooks)
    async with running(pipeline, journal):
        written_well_before(write_marked(watch, "ck-1", 8 * PART))
        await ship_until_a_part_is_sent(pipeline, "ck-1")
        noticed_at_origin = time.time() - 0.01
        write_marked(watch, "ck-2", MiB)
        await pipeline.evaluate("run", "ck-2")
        assert not pipeline.queue.get("run", "ck-2").emergency  # type: ignore[union-attr]
        # The other node's notice reaches this daemon now, dated when it began there.
        pipeline.emergency.enter_emergency(
            datetime.now(UTC) + timedelta(seconds=1), since=noticed_at_origin
        )
        await wait_until(
            lambda: (p := pipeline.queue.get("run", "ck-2")) is None or p.emergency,
            timeout=30,
            what="ck-2 counted as the emergency checkpoint",
        )
        await wait_until(lambda: len(order) == 2, timeout=60, what="both committed")
    assert order == [("ck-2", True), ("ck-1", False)]


async def test_a_routine_checkpoint_queued_a_moment_before_a_local_notice_stays_routine(
    tmp_path: Path,
) -> None:
    """A save made half a second before this node's own notice (within the slack a fresh
    checkpoint gets) was not made for it: the trainer's save for the notice, written
    after it, is the emergency checkpoint and commits first (CI saw ``ckptd exec`` report
    the older one as the emergency checkpoint)."""
    order, hooks = record_commits()
    pipeline, journal, watch = make_pipeline(tmp_path, mib_per_s=8, hooks=hooks)
    async with running(pipeline, journal):
        written_well_before(write_marked(watch, "ck-1", 8 * PART))
        await ship_until_a_part_is_sent(pipeline, "ck-1")
        routine = write_marked(watch, "ck-2", MiB)
        half_a_second_ago = time.time() - 0.5
        for f in routine.iterdir():
            os.utime(f, (half_a_second_ago, half_a_second_ago))
        await pipeline.evaluate("run", "ck-2")
        pipeline.emergency.enter_emergency(datetime.now(UTC) + timedelta(seconds=1))
        write_marked(watch, "ck-3", MiB)
        await pipeline.evaluate("run", "ck-3")
        await wait_until(lambda: len(order) == 3, timeout=60, what="all three committed")
    assert order[0] == ("ck-3", True), order
    assert sorted(order[1:]) == [("ck-1", False), ("ck-2", False)], order


async def test_a_checkpoint_already_committed_elsewhere_is_marked_committed_without_shipping(
    tmp_path: Path,
) -> None:
    first, journal, watch = make_pipeline(tmp_path, mib_per_s=0)
    write_marked(watch, "ck-3", MiB)
    await first.evaluate("run", "ck-3")
    assert await first.drain_once()
    await first.close()
    journal.close()
    # A second pipeline with a fresh journal (a new node) finds the manifest in the store.
    state2 = tmp_path / "state2"
    state2.mkdir()
    journal2 = Journal(state2)
    second = SyncPipeline(first.settings, first.repo.storage, journal2, Metrics())
    try:
        await second.evaluate("run", "ck-3")
        assert await second.drain_once()
        assert "ck-3" in second.runs["run"].committed
        assert sent_bytes(second) == 0
    finally:
        await second.close()
        journal2.close()


async def test_a_restart_after_a_crash_between_manifest_and_latest_moves_latest(
    tmp_path: Path,
) -> None:
    # Found by the kill -9 campaign (tests/campaigns): killed after ck-5's manifest was
    # written but before LATEST moved, the restarted daemon saw "already committed" and
    # left LATEST on ck-3, so `restore --latest` would resume two steps back.
    first, journal, watch = make_pipeline(tmp_path, mib_per_s=0)
    for name in ("ck-3", "ck-5"):
        write_marked(watch, name, MiB)
        await first.evaluate("run", name)
        assert await first.drain_once()
        if name == "ck-3":
            behind = first.repo.read_latest("run")
    await first.close()
    journal.close()
    assert behind is not None and behind.checkpoint == "ck-3"
    first.repo.write_latest("run", behind)  # LATEST as the crash left it
    second = SyncPipeline(
        first.settings, first.repo.storage, Journal(tmp_path / "state"), Metrics()
    )
    try:
        await second.evaluate("run", "ck-5")
        await second.drain_once()
        latest = second.repo.read_latest("run")
        assert latest is not None and latest.checkpoint == "ck-5"
    finally:
        await second.close()
        second.journal.close()


async def test_a_failing_store_backs_off_and_counts_a_storage_error(tmp_path: Path) -> None:
    pipeline, journal, watch = make_pipeline(tmp_path, mib_per_s=0)
    # Before any failure every series an alert watches is there, at 0: a series born at
    # 1 has no earlier sample and increase() would miss the first failure.
    text = pipeline.metrics.render().decode()
    for reason in FAILURE_REASONS:
        assert f'ckptd_checkpoints_failed_total{{reason="{reason}",run="run"}} 0.0' in text
    for kind in STORAGE_ERROR_KINDS:
        assert f'ckptd_storage_errors_total{{kind="{kind}",operation="checkpoint"}} 0.0' in text
    # The destination's root is now a plain file: every write under it fails for good.
    (tmp_path / "store").rmdir()
    (tmp_path / "store").write_text("not a directory")
    write_marked(watch, "ck-4", MiB)
    try:
        await pipeline.evaluate("run", "ck-4")
        assert not await pipeline.drain_once()
        pending = pipeline.queue.get("run", "ck-4")
        assert pending is not None and pending.failures == 1
        assert pending.not_before > pipeline.clock.monotonic()  # held back by the backoff
        errors = pipeline.metrics.storage_errors.collect()[0].samples
        counted = {s.labels["kind"]: s.value for s in errors if s.name.endswith("_total")}
        assert sum(counted.values()) == 1 and set(counted) == set(STORAGE_ERROR_KINDS), counted
        failed = {
            s.labels["reason"]: s.value
            for s in pipeline.metrics.failed.collect()[0].samples
            if s.name.endswith("_total")
        }
        assert sum(failed.values()) == 1 and failed["storage"] + failed["unusable"] == 1, failed
        assert pipeline.status()["runs"]["run"]["pending"] == ["ck-4"]
    finally:
        await pipeline.close()
        journal.close()


async def test_an_unforeseen_error_in_one_checkpoint_never_stops_the_worker(
    tmp_path: Path,
) -> None:
    """Whatever one checkpoint's ship raises (here a bug injected into the shipper), it
    is said and backed off, and the worker goes on to the next checkpoint."""
    pipeline, journal, watch = make_pipeline(tmp_path, mib_per_s=0)
    real_ship = pipeline.shipper.ship

    async def ship(request: Any) -> Any:
        if request.listing.name == "ck-bad":
            raise RuntimeError("a bug nobody foresaw")
        return await real_ship(request)

    pipeline.shipper.ship = ship  # type: ignore[method-assign]
    async with running(pipeline, journal) as worker:
        write_marked(watch, "ck-bad", 1000)
        await pipeline.evaluate("run", "ck-bad")
        # ck-bad fails first (a loaded machine may wake the worker late: wait for it, or
        # ck-good, which has no step either, could go first and prove nothing).
        deadline = asyncio.get_running_loop().time() + 60
        while (bad := pipeline.queue.get("run", "ck-bad")) is None or bad.failures < 1:
            assert not worker.done(), worker
            assert asyncio.get_running_loop().time() < deadline, "ck-bad was never tried"
            await asyncio.sleep(0.02)
        write_marked(watch, "ck-good", 1000)
        await pipeline.evaluate("run", "ck-good")
        while "ck-good" not in pipeline.runs["run"].committed:
            assert not worker.done(), worker
            assert asyncio.get_running_loop().time() < deadline, "ck-good never committed"
            await asyncio.sleep(0.02)
        pending = pipeline.queue.get("run", "ck-bad")
        assert pending is not None and pending.failures >= 1  # backed off, not forgotten
        failed = pipeline.metrics.registry.get_sample_value(
            "ckptd_checkpoints_failed_total", {"run": "run", "reason": "local"}
        )
        assert failed is not None and failed >= 1


async def test_on_a_notice_the_checkpoint_being_written_ships_its_files_first(
    tmp_path: Path,
) -> None:
    """During a notice, the closed files of the checkpoint the trainer is writing go
    before its commit record exists and before an older checkpoint's upload, which
    makes way; an older incomplete checkpoint sends nothing early meanwhile."""
    order, hooks = record_commits()
    # 4 MiB/s: the older checkpoint's 40 MiB take 10 s, so it is still in flight when the
    # emergency one arrives, however slowly a loaded machine runs the steps between.
    pipeline, journal, watch = make_pipeline(tmp_path, mib_per_s=4, hooks=hooks)
    store = tmp_path / "store"
    long_ago = time.time() - 60
    older = write_marked(watch, "ck-1", 8 * PART)
    stale = watch / "ck-0"  # an older save never finished: no COMPLETE
    stale.mkdir()
    (stale / "weights.bin").write_bytes(os.urandom(MiB))
    for f in [*older.iterdir(), *stale.iterdir()]:
        os.utime(f, (long_ago, long_ago))
    async with running(pipeline, journal):
        await ship_until_a_part_is_sent(pipeline, "ck-1")
        # No deadline: the older upload can never be known to fit beside the emergency
        # one, so it makes way however long the steps below take on a loaded machine (a
        # deadline 1 s away passed before the commit record on one, and then both fit).
        pipeline.emergency.enter_emergency(None)
        # The notice came 10 s ago (shifted, not slept): the trainer has since written
        # and closed its weights (quiet for 5 s), and not yet its commit record.
        assert pipeline.emergency.since is not None
        pipeline.emergency.since -= 10
        being_written = watch / "ck-2"
        being_written.mkdir()
        (being_written / "weights.bin").write_bytes(os.urandom(2 * MiB))
        quiet = time.time() - 5
        os.utime(being_written / "weights.bin", (quiet, quiet))
        await pipeline.evaluate("run", "ck-0")
        await pipeline.evaluate("run", "ck-2")
        await wait_until(
            lambda: (store / "run" / "ck-2" / "weights.bin").is_file(),
            timeout=30,
            what="the emergency checkpoint's weights sent before its commit record",
        )
        assert order == []  # the older one has not committed ahead of it
        assert not (store / "run" / "ck-0").exists()  # nothing early from an old save
        # The emergency's bytes went on the urgent pool: threads that never idle.
        policies = {
            t.name.rsplit("_", 1)[0]: os.sched_getscheduler(t.native_id or 0)
            for t in threading.enumerate()
            if t.name.startswith("ckptd-io")
        }
        assert policies == {"ckptd-io": os.SCHED_IDLE, "ckptd-io-urgent": os.SCHED_OTHER}
        (being_written / "COMPLETE").write_text("")
        await pipeline.evaluate("run", "ck-2")
        await wait_until(lambda: len(order) == 2, timeout=60, what="both committed")
    assert order == [("ck-2", True), ("ck-1", False)]
    assert not (store / "run" / "ck-0").exists()
