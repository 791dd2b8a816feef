"""The goodput recorder (``ckptd.goodput.recorder``) on a real directory store, with a
manual clock and the trainer's step reports written by hand: a crash and restart on one
node, then a fresh node (another host) that restores the run and continues the same
ledger; a store that refuses writes costs nothing journaled."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ckptd.goodput.model import Interval, Mark, goodput
from ckptd.goodput.recorder import STEPS_RELPATH, GoodputRecorder, read_ledger
from ckptd.runtime.clock import ManualClock
from ckptd.storage import open_storage
from ckptd.store.repository import Repository


def report(watch: Path, step: int, at: float, first: tuple[float, int]) -> None:
    path = watch / STEPS_RELPATH
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"step": step, "at": at, "pid": 1, "first_at": first[0], "first_step": first[1]}
    path.write_text(json.dumps(body))


def train(rec: GoodputRecorder, clock: ManualClock, watch: Path, steps: range) -> None:
    """One step a second, the recorder polling after each."""
    first = (clock.time() + 1, steps.start)
    for step in steps:
        clock.advance(1)
        report(watch, step, clock.time(), first)
        rec.poll()


def test_a_crash_a_restart_and_a_fresh_node_make_one_ledger(tmp_path: Path) -> None:
    repo = Repository(open_storage(f"file://{tmp_path / 'store'}"))
    clock = ManualClock()
    t0 = clock.time()

    # Node A: starts from scratch, trains steps 1..25, saves at 20 (committed), crashes.
    watch_a = tmp_path / "a" / "run"
    a = GoodputRecorder("run1", watch_a, repo, tmp_path / "a" / "state", "node-a", clock=clock)
    asyncio.run(a.load())
    clock.advance(2)
    a.trainer_started(None)
    clock.advance(3)  # start-up until the first step
    train(a, clock, watch_a, range(1, 26))
    clock.advance(0.5)
    a.trainer_ended("signal:SIGKILL", interrupted=True)
    clock.advance(1.5)  # the restart delay
    a.restarting(20)
    a.trainer_started(20)
    clock.advance(2)
    train(a, clock, watch_a, range(21, 31))
    a.noticed(clock.time(), "aws")
    clock.advance(0.2)
    a.trainer_ended("notice", interrupted=True)
    clock.advance(0.3)
    a.flushed()
    asyncio.run(a.ship())
    a_end = clock.time()

    # Node B, a fresh host, 60 s later: restores step 30 and finishes at 40.
    clock.advance(60)
    watch_b = tmp_path / "b" / "run"
    b = GoodputRecorder("run1", watch_b, repo, tmp_path / "b" / "state", "node-b", clock=clock)
    asyncio.run(b.load())
    b.restored(clock.time(), clock.time() + 4)
    clock.advance(4)
    b.trainer_started(30)
    clock.advance(2)
    train(b, clock, watch_b, range(31, 41))
    b.trainer_ended("exit:0", interrupted=False)
    b.finished()
    asyncio.run(b.ship())

    records = read_ledger(repo, "run1")
    g = goodput(records)
    assert {r.node for r in records} == {"node-a", "node-b"}
    assert g.start == t0 and g.wall == clock.time() - t0
    assert sum(g.seconds.values()) == g.wall
    # Steps 21..25 were done twice: 5 steps, from step 20's report to the crash (5.5 s).
    (crash, notice) = g.interruptions
    assert (crash.cause, crash.lost_steps, crash.lost_seconds) == ("signal:SIGKILL", 5, 5.5)
    assert (notice.cause, notice.lost_steps) == ("notice", 0)
    # The restart delay, the gap between the nodes, and the notice's trainer's way out.
    assert g.seconds["down"] == pytest.approx(1.5 + 60 + 0.2)
    assert g.seconds["restore"] == 4
    # Productive: steps 2..20 (19 s), 22..30 (9 s), 32..40 (9 s): first steps count as start-up.
    assert g.seconds["productive"] == 19 + 9 + 9
    gap = [r for r in records if isinstance(r, Interval) and r.basis == "ledger-gap"]
    assert [(r.node, r.start, r.end) for r in gap] == [("node-b", a_end, a_end + 60)]
    assert sum(1 for r in records if isinstance(r, Mark) and r.kind == "finished") == 1


def test_what_the_store_refused_is_shipped_by_the_next_life(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = Repository(open_storage(f"file://{store}", max_attempts=1))
    clock = ManualClock()
    state = tmp_path / "state"
    first = GoodputRecorder("run1", tmp_path / "w", repo, state, "n", clock=clock)
    asyncio.run(first.load())
    first.trainer_started(None)
    clock.advance(5)
    first.trainer_ended("exit:1", interrupted=True)
    # The store refuses the write (the run's prefix is a file: ENOTDIR): nothing shipped.
    store.mkdir(parents=True, exist_ok=True)
    (store / "run1").write_text("in the way")
    asyncio.run(first.ship())
    assert first._shipped() == 0
    (store / "run1").unlink()
    journaled = {json.loads(line)["id"] for line in first.journal_lines()}
    # A later life (same state dir) ships it before anything else.
    second = GoodputRecorder("run1", tmp_path / "w", repo, state, "n", clock=clock)
    asyncio.run(second.load())
    stored = {r.id for r in read_ledger(repo, "run1")}
    assert journaled <= stored
