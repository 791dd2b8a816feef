"""The goodput recorder (``ckptd.goodput.recorder``) on a real directory store, with a
manual clock and the trainer's step reports written by hand: a crash and restart on one
node, then a fresh node (another host) that restores the run and continues the same
ledger; a store that refuses writes costs nothing journaled. And the step counter a real
trainer process leaves when it is killed with ``kill -9``."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.goodput.model import Interval, Mark, goodput
from ckptd.goodput.recorder import GoodputRecorder, read_ledger
from ckptd.goodput.step_report import STEPS_RELPATH, read_steps
from ckptd.repository import Repository
from ckptd.runtime.clock import ManualClock
from ckptd.storage import open_storage
from tests.support.daemon import wait_until
from tests.support.trainers.procs import script_env


def report(watch: Path, step: int, at: float, first: tuple[float, int]) -> None:
    """The step report as JSON (the helpers' fallback): its times are the manual clock's."""
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
    a.exec_started(None)
    clock.advance(3)  # start-up until the first step
    train(a, clock, watch_a, range(1, 26))
    clock.advance(0.5)
    a.trainer_ended("signal:SIGKILL", interrupted=True)
    clock.advance(1.5)  # the restart delay
    a.exec_started(20)
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
    b.exec_started(30)
    clock.advance(2)
    train(b, clock, watch_b, range(31, 41))
    clock.advance(0.5)  # its way out after its last step (interpreter teardown): no work
    b.trainer_ended("exit:0", interrupted=False)
    b.finished()
    clock.advance(1)
    b.stopped("exit:0")
    asyncio.run(b.ship())

    records = read_ledger(repo, "run1")
    g = goodput(records)
    assert {r.node for r in records} == {"node-a", "node-b"}
    # The run finished with its last step: neither B's way out nor its stop is in it.
    assert g.start == t0 and g.wall == clock.time() - 1.5 - t0
    assert goodput(records, now=clock.time() + 3600).wall == g.wall  # it ended
    assert g.attempts == 3  # trainer starts: node B's restore is no attempt of its own
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
    bases_b = [r.basis for r in records if isinstance(r, Interval) and r.node == "node-b"]
    assert "trainer-exit" not in bases_b  # nothing of a normal exit is down
    gap = [r for r in records if isinstance(r, Interval) and r.basis == "ledger-gap"]
    assert [(r.node, r.start, r.end) for r in gap] == [("node-b", a_end, a_end + 60)]
    assert sum(1 for r in records if isinstance(r, Mark) and r.kind == "finished") == 1


def test_a_life_killed_before_its_trainer_started_leaves_the_lost_steps_to_the_next(
    tmp_path: Path,
) -> None:
    """kill -9 of ``ckptd exec`` while training, again before its next life started a
    trainer (restoring, slow to start), then a third life resumes: the steps the first
    trainer did past the checkpoint are lost, whichever life says so."""
    repo = Repository(open_storage(f"file://{tmp_path / 'store'}"))
    clock = ManualClock()
    state, watch = tmp_path / "state", tmp_path / "run"

    def life() -> GoodputRecorder:
        rec = GoodputRecorder("run1", watch, repo, state, "node-a", clock=clock)
        asyncio.run(rec.load())
        return rec

    first = life()
    first.exec_started(None)
    clock.advance(2)
    train(first, clock, watch, range(1, 26))  # steps 1..25; step 20 is the newest commit
    clock.advance(3)
    life()  # the second: killed while it restores, no trainer started
    clock.advance(2)
    third = life()
    clock.advance(1)
    third.exec_started(20)
    clock.advance(2)
    train(third, clock, watch, range(21, 31))
    third.trainer_ended("exit:0", interrupted=False)
    third.finished()
    third.stopped("exit:0")
    asyncio.run(third.ship())

    g = goodput(read_ledger(repo, "run1"))
    gone = [i for i in g.interruptions if i.cause == "exec-gone"]
    assert len(gone) == 2, g.interruptions
    # Steps 21..25 were done twice: the first trainer's, lost when the third resumed at 20.
    assert sum(i.lost_steps or 0 for i in g.interruptions) == 5, g.interruptions
    assert g.seconds["lost"] == pytest.approx(5)


def test_what_the_store_refused_is_shipped_by_the_next_life(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = Repository(open_storage(f"file://{store}", max_attempts=1))
    clock = ManualClock()
    state = tmp_path / "state"
    first = GoodputRecorder("run1", tmp_path / "w", repo, state, "n", clock=clock)
    asyncio.run(first.load())
    first.exec_started(None)
    clock.advance(5)
    first.trainer_ended("exit:1", interrupted=True)
    # The store refuses the write (the run's prefix is a file: ENOTDIR): nothing shipped.
    store.mkdir(parents=True, exist_ok=True)
    (store / "run1").write_text("in the way")
    asyncio.run(first.ship())
    assert first.journal.shipped() == 0
    (store / "run1").unlink()
    journaled = {json.loads(line)["id"] for line in first.journal.lines()}
    # A later life (same state dir) ships it before anything else.
    second = GoodputRecorder("run1", tmp_path / "w", repo, state, "n", clock=clock)
    asyncio.run(second.load())
    stored = {r.id for r in read_ledger(repo, "run1")}
    assert journaled <= stored


# Reports steps as fast as it can up to argv[1], says so, and waits to be killed.
REPORTER = """
import sys, threading
import ckptd.trainer
last = int(sys.argv[1])
for step in range(int(sys.argv[2]), last + 1):
    ckptd.trainer.report_step(step)
print(last, flush=True)
threading.Event().wait()
"""


def test_the_step_counter_survives_kill_9_up_to_the_last_completed_step(tmp_path: Path) -> None:
    """Two trainer processes, one after the other, each killed with ``kill -9`` right after
    its last report: the counter says the last step each completed, and the second's
    first report kept the first's last one."""
    watch = tmp_path / "run"
    env = script_env(tmp_path, CKPTD_WATCH_DIR=str(watch))
    pids = []
    for first, last in ((1, 5003), (4001, 4017)):
        proc = subprocess.Popen(
            [sys.executable, "-c", REPORTER, str(last), str(first)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == str(last)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        proc.stdout.close()
        pids.append(proc.pid)
        reports = read_steps(watch)
        assert reports.current is not None
        assert (reports.current.step, reports.current.first_step) == (last, first)
        assert reports.current.pid == proc.pid
    assert reports.previous is not None
    assert (reports.previous.step, reports.previous.pid) == (5003, pids[0])


# -- beside ckptd run: the sidecar's ledger from what it observes --------------------------------

# A trainer that reports steps from argv[1] + 1 to argv[2] (10 ms each), writes its pidfile
# (argv[3]) first, and hangs after the last one.
STEPPER = """
import os, sys, threading, time
import ckptd.trainer
open(sys.argv[3], "w").write(str(os.getpid()))
for step in range(int(sys.argv[1]) + 1, int(sys.argv[2]) + 1):
    time.sleep(0.01)
    ckptd.trainer.report_step(step)
threading.Event().wait()
"""


def test_a_restarted_sidecar_adopts_the_running_trainer_and_sees_it_restarted(
    tmp_path: Path,
) -> None:
    """``ckptd run`` (its ledger, polled here) killed and restarted while its trainer runs
    on: the new life goes on recording the same attempt (no interruption, no second
    attempt); then the trainer is killed and started again from step 20, and the ledger
    has one interruption that lost the 10 steps past it, and two attempts."""
    from ckptd.goodput.sidecar import SidecarLedger, TrainerView

    repo = Repository(open_storage(f"file://{tmp_path / 'store'}"))
    watch, state, pidfile = tmp_path / "run", tmp_path / "state", tmp_path / "trainer.pid"
    env = script_env(tmp_path, CKPTD_WATCH_DIR=str(watch))
    view = TrainerView(pidfile=str(pidfile))
    trainers: list[subprocess.Popen[bytes]] = []

    def trainer(resumed: int, last: int) -> None:
        pidfile.unlink(missing_ok=True)
        cmd = [sys.executable, "-c", STEPPER, str(resumed), str(last), str(pidfile)]
        trainers.append(subprocess.Popen(cmd, env=env))

    def polled_until(ledger: SidecarLedger, step: int) -> None:
        def seen() -> bool:
            ledger.poll()
            return bool(ledger.rec.samples) and ledger.rec.samples[-1][1] == step

        wait_until(seen, 60, f"step {step} seen", interval=0.05)

    try:
        first = SidecarLedger("run1", watch, repo, state, "node-a", view)
        asyncio.run(first.start())
        trainer(0, 30)
        polled_until(first, 30)
        asyncio.run(first.ship())  # then it is killed: no stop marked

        second = SidecarLedger("run1", watch, repo, state, "node-a", view)
        asyncio.run(second.start())
        second.poll()
        assert second.current is not None and second.rec.attempt == first.rec.attempt
        polled_until(second, 30)
        trainers[0].kill()
        trainers[0].wait()
        trainer(20, 25)
        polled_until(second, 25)
        asyncio.run(second.stop())
    finally:
        for proc in trainers:
            proc.kill()
            proc.wait()

    records = read_ledger(repo, "run1")
    g = goodput(records)
    assert g.attempts == 2
    assert [(i.cause, i.lost_steps) for i in g.interruptions] == [("trainer-gone", 10)]
    assert not any(isinstance(r, Mark) and r.detail == "writer-gone" for r in records)
