"""The daemon yields to the trainer: its threads run at a lower CPU and I/O priority,
and what it ships leaves the page cache behind it.

Residency is read with ``fincore`` (util-linux: ``mincore(2)`` over a mapping of the
file), which counts a file's pages in the page cache. Each residency test has its
control: the same shipment with ``drop_page_cache = false`` leaves the file cached, so
the assertion can fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from ckptd.devtools.locals3 import LocalS3
from ckptd.runtime.yielding import Priority, idle_this_thread, lower_this_thread
from ckptd.storage.fs import FileStorage
from ckptd.sync.journal import Journal
from ckptd.sync.transfer import Transfers
from tests.conftest import DAEMON_AT_TEST_PRIORITY
from tests.support.daemon import Daemon, wait_until
from tests.support.ops import hf_daemon
from tests.support.writers import write_hf

MIB = 1024 * 1024


@pytest.fixture
def daemons_at_their_own_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemons of the priority tests choose their priority themselves, as in
    production: the suite's override (tests/conftest.py, DAEMON_AT_TEST_PRIORITY) is taken
    away. Those daemons yield to any other work by design: while nice-0 work saturates every
    core, their SCHED_IDLE transfer threads get no CPU and cannot commit. The page-cache
    tests are about the cache, not the priority, and keep the override."""
    for name in DAEMON_AT_TEST_PRIORITY:
        monkeypatch.delenv(name, raising=False)


def _in_thread(fn: object) -> object:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    t.start()
    t.join()
    return out[0]


def test_lower_this_thread_moves_only_the_calling_thread_and_only_down() -> None:
    main = psutil.Process(threading.get_native_id())
    main_nice, main_io = main.nice(), tuple(main.ionice())

    def lowered() -> tuple[int, tuple[int, int], list[str], int]:
        me = psutil.Process(threading.get_native_id())
        problems = lower_this_thread(
            Priority(nice=main_nice + 5, io_class="best-effort", io_level=6)
        )
        # Asking for less than it has now changes nothing (never moves up).
        problems += lower_this_thread(
            Priority(nice=main_nice + 1, io_class="best-effort", io_level=2)
        )
        after = me.nice()
        return after, tuple(me.ionice()), problems, me.nice()

    nice, io, problems, _ = _in_thread(lowered)  # type: ignore[misc]
    assert problems == []
    assert nice == main_nice + 5
    assert (int(io[0]), int(io[1])) == (psutil.IOPRIO_CLASS_BE, 6)
    assert main.nice() == main_nice and tuple(main.ionice()) == main_io

    def idle() -> tuple[int, int]:
        lower_this_thread(Priority(nice=0, io_class="idle"))
        return tuple(psutil.Process(threading.get_native_id()).ionice())  # type: ignore[return-value]

    assert int(_in_thread(idle)[0]) == psutil.IOPRIO_CLASS_IDLE  # type: ignore[index]


def test_idle_this_thread_moves_only_the_calling_thread_to_sched_idle() -> None:
    def idle() -> tuple[list[str], int]:
        problems = idle_this_thread()
        return problems, os.sched_getscheduler(0)

    problems, policy = _in_thread(idle)  # type: ignore[misc]
    assert problems == [] and policy == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def _idle_or_fail() -> None:
    assert idle_this_thread() == []


def test_transfers_run_on_idle_threads_except_while_urgent(tmp_path: Path) -> None:
    """Routine leaf operations run on SCHED_IDLE threads; while urgent (a notice), on
    threads of a second pool that never entered SCHED_IDLE (it cannot be left)."""
    urgent = threading.Event()
    transfers = Transfers(
        FileStorage(tmp_path / "store"),
        Journal(tmp_path / "state"),
        part_size=8 * MIB,
        concurrency=2,
        thread_setup=_idle_or_fail,
        is_urgent=urgent.is_set,
    )

    async def policy_now() -> int:
        return await transfers._in_pool(lambda: os.sched_getscheduler(0))

    try:
        assert asyncio.run(policy_now()) == os.SCHED_IDLE
        urgent.set()
        assert asyncio.run(policy_now()) == os.SCHED_OTHER
        urgent.clear()
        assert asyncio.run(policy_now()) == os.SCHED_IDLE
    finally:
        transfers.close()


def _thread_priorities(pid: int) -> list[tuple[int, int, int]]:
    """(nice, I/O class, I/O level) of every thread of ``pid`` alive through the read (a
    short-lived worker thread may end between the listing and its own read)."""
    out = []
    for thread in psutil.Process(pid).threads():
        try:
            t = psutil.Process(thread.id)
            cls, level = t.ionice()
            out.append((t.nice(), int(cls), int(level)))
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (19, psutil.IOPRIO_CLASS_BE, 7)),
        (
            {
                "CKPTD_RESOURCES__NICE": "0",
                "CKPTD_RESOURCES__IO_CLASS": "none",
                "CKPTD_RESOURCES__CPU_POLICY": "normal",
            },
            None,  # as started: the test's own priority
        ),
    ],
    ids=["defaults", "off"],
)
@pytest.mark.usefixtures("daemons_at_their_own_priority")
def test_every_daemon_thread_runs_at_the_configured_priority(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_dest: str,
    env: dict[str, str],
    expected: tuple[int, int, int] | None,
) -> None:
    daemon, root = hf_daemon(tmp_path, local_s3, s3_dest, env=env)
    mine = psutil.Process()
    with daemon:
        write_hf(root, 1, model_bytes=12 * MIB)  # multipart: the transfer pool is busy
        wait_until(
            lambda: daemon.metric("ckptd_checkpoints_committed_total", run="run1") >= 1,
            60,
            "commit",
        )
        assert daemon.proc is not None
        threads = _thread_priorities(daemon.proc.pid)
        assert len(threads) > 3, threads  # the loop, the transfer pool, the watcher...
        policies = {
            t.id: os.sched_getscheduler(t.id) for t in psutil.Process(daemon.proc.pid).threads()
        }
        # The event loop never idles; the transfer threads do, by default only.
        assert policies[daemon.proc.pid] == os.SCHED_OTHER
        idle = [tid for tid, policy in policies.items() if policy == os.SCHED_IDLE]
        assert bool(idle) == (expected is not None), policies
        if expected is None:
            cls, _level = mine.ionice()
            assert {t[0] for t in threads} == {mine.nice()}, threads
            assert {t[1] for t in threads} == {int(cls)}, threads
        else:
            assert set(threads) == {expected}, threads
        assert daemon.stop() == 0


def _resident_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return int(out.strip() or 0)


def _resident(paths: list[Path]) -> float:
    total = sum(p.stat().st_size for p in paths)
    return sum(_resident_bytes(p) for p in paths) / total


needs_fincore = pytest.mark.skipif(
    shutil.which("fincore") is None, reason="fincore not installed (apt: util-linux)"
)


def _ship(daemon: Daemon, root: Path) -> list[Path]:
    """Write (and fsync: clean pages) a checkpoint, check it is cached, let it commit."""
    ckpt = write_hf(root, 1, model_bytes=24 * MIB)
    files = sorted(p for p in ckpt.iterdir() if p.stat().st_size >= MIB)
    # Read once: every page cached before ckptd touches it.
    for p in files:
        p.read_bytes()
    assert _resident(files) > 0.95, "precondition: the checkpoint is in the page cache"
    with daemon:
        wait_until(
            lambda: daemon.metric("ckptd_checkpoints_committed_total", run="run1") >= 1,
            60,
            "commit",
        )
        assert daemon.stop() == 0
    return files


@needs_fincore
@pytest.mark.parametrize("drop", [True, False], ids=["drop", "control-keep"])
def test_shipping_to_s3_leaves_the_checkpoint_out_of_the_page_cache(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, drop: bool
) -> None:
    daemon, root = hf_daemon(
        tmp_path,
        local_s3,
        s3_dest,
        part_size_mib=8,
        env={"CKPTD_RESOURCES__DROP_PAGE_CACHE": str(drop).lower()},
    )
    files = _ship(daemon, root)
    resident = _resident(files)
    print(f"drop_page_cache={drop}: {resident:.1%} of the shipped files still cached")
    if drop:
        assert resident < 0.05
    else:
        assert resident > 0.9


@needs_fincore
def test_file_destination_leaves_neither_source_nor_copy_in_the_page_cache(
    tmp_path: Path, local_s3: LocalS3
) -> None:
    store = tmp_path / "store"
    daemon, root = hf_daemon(
        tmp_path, local_s3, f"file://{store}", endpoint_url="", part_size_mib=8
    )
    files = _ship(daemon, root)
    copies = sorted(p for p in store.rglob("*") if p.is_file() and p.stat().st_size >= MIB)
    assert len(copies) == len(files), copies
    assert _resident(files) < 0.05
    assert _resident(copies) < 0.05


_EXEC_TRAINER = """
import json, os, pathlib, time
import psutil
ckpt = pathlib.Path(os.environ["CKPTD_WATCH_DIR"]) / "step-1"
ckpt.mkdir(parents=True, exist_ok=True)
(ckpt / "weights").write_bytes(os.urandom(1 << 20))
(ckpt / "COMPLETE").write_text("")
daemon = psutil.Process(os.getppid())

def workers():
    # Python 3.11 names no OS threads: the daemon's threads other than its main one.
    out = []
    for t in daemon.threads():
        if t.id != daemon.pid:
            try:
                p = psutil.Process(t.id)
                out.append([p.nice(), *map(int, p.ionice())])
            except psutil.NoSuchProcess:  # a thread that ended since the listing
                pass
    return out

# A thread sets its nice, then its I/O class: wait for one lowered in both, not one
# caught between the two steps.
lowered = [19, int(psutil.IOPRIO_CLASS_BE), 7]
deadline = time.monotonic() + 60
while lowered not in workers() and time.monotonic() < deadline:
    time.sleep(0.1)
me = psutil.Process()
json.dump({"trainer": [me.nice(), *map(int, me.ionice())], "workers": workers(),
           "daemon_main": daemon.nice()}, open("prio.json", "w"))
"""


@pytest.mark.usefixtures("daemons_at_their_own_priority")
def test_ckptd_exec_lowers_its_workers_but_not_the_trainer_it_starts(tmp_path: Path) -> None:
    from tests.process.test_exec import _quick_node

    node = _quick_node(tmp_path, [sys.executable, "-c", _EXEC_TRAINER], 0)
    node.config.write_text(
        node.config.read_text().replace("settle_seconds", 'layout = "marker"\nsettle_seconds')
    )
    mine = psutil.Process()
    try:
        assert node.start().wait_exit(90) == 0, node.log_tail()
    finally:
        node.close()
    prio = json.loads((node.dir / "prio.json").read_text())
    own_class = int(mine.ionice()[0])
    assert prio["trainer"][:2] == [mine.nice(), own_class], prio
    assert prio["daemon_main"] == mine.nice(), prio  # the trainer's parent keeps it too
    # The transfer pool's threads lowered themselves as they started.
    assert [19, int(psutil.IOPRIO_CLASS_BE), 7] in prio["workers"], prio
