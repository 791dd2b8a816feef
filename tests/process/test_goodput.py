"""Goodput under ``ckptd exec``, at the default step-report settings: a real trainer, killed
(``kill -9``) twice a known number of steps past a checkpoint, then preempted (SIGTERM),
then finished on a fresh node. The run ledger in the store is checked against the
trainer's own log of its steps (each line ``pid step time``):

- the lost steps it records equal the steps the trainer really did twice, per interruption;
- its causes sum to the wall time;
- its goodput is within 2 points of the test's own: the time the trainer spent on steps
  it kept (from its step timestamps) over the wall time;
- its attempts are the trainer's starts, and once the first node stopped, its run stops
  accruing unknown time.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.goodput.model import Interval, Mark, Record, goodput, merge_records
from ckptd.goodput.recorder import read_ledger
from ckptd.repository import Repository
from ckptd.runtime.processes import cmdline_of
from ckptd.storage import open_storage
from ckptd.supervision.supervisor import process_tree
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.exec_harness import ExecNode, _alive, trainer_command
from tests.support.harness import RUN_ID, Env, TrainerSpec
from tests.support.trainers.procs import script_env

SEED = 20261204
# The kill -9 campaign's seed (GOODPUT_CAMPAIGN_SEED for another; not CKPTD_*: the daemon
# refuses an unknown CKPTD_ variable).
CAMPAIGN_SEED = int(os.environ.get("GOODPUT_CAMPAIGN_SEED", SEED + 1))
SPEC = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=60,
    save_every=20,
    step_delay=0.05,
    interruptions=3,
    checkpoint_name="step-{}",
)
# The trainer hangs at each of these steps the first time it reaches it, and is killed
# there: 7 steps past the checkpoint at 20, then, resumed from it, 13 past it.
KILLED_AT = (27, 33)
# Then it waits for the notice after this step (its checkpoint, then one step more).
NOTICE_AT = 40


def command(node_dir: Path, *extra: str) -> list[str]:
    """The trainer at the default step-report settings (no CKPTD_STEP_REPORT_SECONDS)."""
    return [*trainer_command(SPEC, node_dir), "--report-saves", *extra]


def interruptions_as_planned(node_dir: Path) -> list[str]:
    hangs = [arg for step in KILLED_AT for arg in ("--hang-once-at", str(step))]
    marks = ["--hang-marks", str(node_dir / "hung")]
    return [*hangs, *marks, "--pause-at", str(NOTICE_AT)]


def step_log(*nodes: ExecNode | SidecarNode) -> list[tuple[int, int, float]]:
    """Every step the trainer did, on every node: (pid, step, time)."""
    out = []
    for node in nodes:
        for line in node.progress.with_suffix(".steps").read_text().splitlines():
            pid, step, at = line.split()
            out.append((int(pid), int(step), float(at)))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return -1.0


def saves_reported(*nodes: ExecNode | SidecarNode) -> list[tuple[float, float]]:
    """Each save the trainer reported: (at, save_seconds)."""
    out = []
    for node in nodes:
        for line in (node.ckpt / ".ckptd" / "saves.jsonl").read_text().splitlines():
            doc = json.loads(line)
            out.append((float(doc["at"]), float(doc["save_seconds"])))
    return out


def redone_per_interruption(log: list[tuple[int, int, float]]) -> list[int]:
    """Per trainer process but the last, the steps it did that the next one did again."""
    by_pid: dict[int, list[int]] = {}
    for pid, step, _ in log:
        by_pid.setdefault(pid, []).append(step)
    steps = list(by_pid.values())  # in start order: the log is appended in time order
    return [max(0, done[-1] - (after[0] - 1)) for done, after in itertools.pairwise(steps)]


def own_goodput(
    log: list[tuple[int, int, float]], saves: list[tuple[float, float]], wall: float
) -> float:
    """The test's own goodput: per trainer process, the time from its first step to the
    last step it did that no later process did again, less its saves (the trainer's own
    save reports), over ``wall``."""
    by_pid: dict[int, list[tuple[int, float]]] = {}
    for pid, step, at in log:
        by_pid.setdefault(pid, []).append((step, at))
    pids = list(by_pid)
    spans = []
    for i, pid in enumerate(pids):
        done = by_pid[pid]
        last_kept = by_pid[pids[i + 1]][0][0] - 1 if i + 1 < len(pids) else done[-1][0]
        times = [at for step, at in done if step <= last_kept]
        if times:  # none: every step it did was done again
            spans.append((times[0], times[-1]))
    save_time = sum(
        min(at, hi) - max(at - seconds, lo)
        for at, seconds in saves
        for lo, hi in spans
        if at - seconds < hi and at > lo
    )
    return (sum(hi - lo for lo, hi in spans) - save_time) / wall


@pytest.mark.slow
def test_the_ledger_matches_what_the_trainer_did(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    env = Env(s3_dest, local_s3.endpoint_url)
    first = ExecNode(tmp_path / "node-a", SPEC, env)
    first.command = command(first.dir, *interruptions_as_planned(first.dir))
    storage = open_storage(s3_dest, endpoint_url=local_s3.endpoint_url)
    try:
        first.start()
        pid = None
        for target in KILLED_AT:
            hung = first.dir / "hung" / f"hung-at-{target}"  # made as it hangs (plain_dcp)
            first.wait_progress(
                lambda d, t=target, mark=hung: d["step"] == t and mark.exists(),
                120,
                f"the trainer hung at step {target}",
            )
            if pid is not None:  # the first kill is journaled, its loss resolved
                live = first.get_json("/v1/status")["goodput"]["run"]
                assert live["interruptions"] == 1 and live["lost_steps"] == 7, live
                assert 0 < live["goodput_ratio"] < 1, live
                text = first.metrics_text()
                assert 0 < metric(text, "ckptd_goodput_ratio", run=RUN_ID) < 1
                assert metric(text, "ckptd_badput_seconds_total", run=RUN_ID, cause="lost") > 0
            pid = first.trainer_pid()
            assert pid is not None and pid == step_log(first)[-1][0]  # the hung one
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda p=pid: not _alive(p), 10, f"trainer {pid} gone")
        first.wait_progress(
            lambda d: first.trainer_pid() != pid and d["step"] == NOTICE_AT,
            120,
            f"the trainer waiting for the notice at step {NOTICE_AT}",
        )
        first.signal(signal.SIGTERM)  # the notice: the emergency checkpoint, exit 0
        assert first.wait_exit(90) == 0, first.log_tail()
    finally:
        first.close()
    # Node A stopped: read a minute later, its run ends where it did, no unknown tail.
    stopped = read_ledger(Repository(storage), RUN_ID)
    later = goodput(stopped, now=time.time() + 60)
    assert later.end == goodput(stopped).end and later.seconds["unknown"] < 0.05, later

    second = ExecNode(tmp_path / "node-b", SPEC, env)  # a fresh node continues the run
    second.command = command(second.dir)
    try:
        second.start()
        assert second.wait_exit(180) == 0, second.log_tail()
    finally:
        second.close()
    assert second.result_doc()["step"] == SPEC.max_steps

    records = read_ledger(Repository(storage), RUN_ID)
    g = goodput(records)
    log = step_log(first, second)
    redone = redone_per_interruption(log)
    print(f"ledger: {g.to_json()}")
    print(
        f"steps re-done per the trainer's log: {redone}; ledger: "
        f"{[i.lost_steps for i in g.interruptions]}"
    )
    assert redone == [7, 13, 0], redone  # as planned: the notice's checkpoint loses none
    assert [i.lost_steps for i in g.interruptions] == redone
    assert g.to_json()["lost_steps"] == sum(redone) == 20
    assert g.attempts == len({pid for pid, _, _ in log}) == 4  # the trainer's starts
    kinds = Counter(r.kind for r in records if isinstance(r, Mark))
    assert kinds["interrupted"] == 3 and kinds["notice"] == 1 and kinds["finished"] == 1, kinds
    assert kinds["stopped"] == 2, kinds  # each ckptd exec's exit
    commits = {r.detail for r in records if isinstance(r, Mark) and r.kind == "commit"}
    assert first.result_doc()["saved"] in commits and f"step-{SPEC.max_steps}" in commits
    assert {r.cause for r in records if isinstance(r, Interval)} >= {"productive", "down"}

    # Causes sum to the wall time (the wall: first record to the run's end).
    assert abs(sum(g.seconds.values()) - g.wall) <= 1e-6 * g.wall
    own = own_goodput(log, saves_reported(first, second), g.wall)
    print(f"goodput: ledger {g.ratio:.3f}, the test's own {own:.3f}; wall {g.wall:.1f} s")
    assert g.ratio is not None
    assert abs(g.ratio - own) <= 0.02
    assert g.seconds["lost"] > 0 and g.seconds["restore"] > 0 and g.seconds["startup"] > 0
    # The fresh node's restore says where its bytes came from: all from the store, peers off.
    restores = [r for r in records if isinstance(r, Interval) and r.basis == "exec-restore"]
    assert restores and all(r.peer_bytes == 0 and (r.store_bytes or 0) > 0 for r in restores)

    # ckptd report says the same, on the terminal and as JSON.
    dest = ["--dest", s3_dest, "--endpoint-url", local_s3.endpoint_url]
    page = tmp_path / "timeline.html"
    shown = run_cli("report", "--run", RUN_ID, *dest, "--html", str(page))
    assert shown.returncode == 0, shown.stderr
    assert page.stat().st_size > 0 and "Plotly.newPlot" in page.read_text()
    assert f"goodput {100 * g.ratio:.1f} %" in shown.stdout, shown.stdout
    assert "attempts 4 on 1 node(s)" in shown.stdout, shown.stdout
    assert "signal:SIGKILL" in shown.stdout and "lost" in shown.stdout, shown.stdout
    doc = json.loads(run_cli("report", "--run", RUN_ID, "--json", *dest).stdout)
    assert doc["goodput"]["lost_steps"] == 20
    assert doc["goodput"]["goodput_ratio"] == pytest.approx(g.ratio, abs=1e-3)


# -- beside ckptd run: the sidecar keeps the ledger ------------------------------------------


@dataclass
class SidecarNode:
    """One node of a pod-like setup: ``ckptd run`` beside a trainer that a plain supervisor
    loop (``tests.support.trainers.restart_loop``) runs and restarts, no ``ckptd exec``."""

    dir: Path
    env: Env
    port: int = field(default_factory=free_port)
    daemon: Daemon | None = None
    loop: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.dir / "run"
        self.progress = self.dir / "progress.json"
        self.pidfile = self.dir / "trainer.pid"
        self.config = self.dir / "ckptd.toml"
        self.config.write_text(
            f"[[watch]]\ndir = {json.dumps(str(self.ckpt))}\nrun_id = {json.dumps(RUN_ID)}\n"
            "settle_seconds = 0.2\n"
            f"[destination]\nurl = {json.dumps(self.env.dest)}\n"
            f"endpoint_url = {json.dumps(self.env.endpoint_url)}\n"
            # The pod's SIGTERM is a notice; the trainer is found as the pod's sidecar finds
            # it, by its command line (the loop's holds the same path: it is matched too).
            '[preemption]\nprovider = "none"\nsigterm = "notice"\n'
            f"[trainer]\nmatch = {json.dumps(str(self.ckpt))}\n"
            f'[metrics]\nlisten = "127.0.0.1:{self.port}"\n'
            f"[state]\ndir = {json.dumps(str(self.dir / 'state'))}\n"
        )

    def start_daemon(self) -> subprocess.Popen[bytes]:
        self.daemon = Daemon(self.config, self.dir / "ckptd.log", self.port).start()
        assert self.daemon.proc is not None
        return self.daemon.proc

    def start_trainer_loop(self, *extra: str) -> subprocess.Popen[bytes]:
        self.start_trainer(*extra)
        assert self.loop is not None
        return self.loop

    def start_trainer(self, *extra: str) -> None:
        trainer = [*trainer_command(SPEC, self.dir), "--report-saves", *extra]
        with (self.dir / "loop.log").open("ab") as log:
            loop = [sys.executable, "-m", "tests.support.trainers.restart_loop"]
            self.loop = subprocess.Popen(
                [*loop, str(self.ckpt), "--", *trainer],
                env=script_env(self.dir, CKPTD_WATCH_DIR=str(self.ckpt)),
                cwd=self.dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def progress_doc(self) -> dict[str, object] | None:
        try:
            doc: dict[str, object] = json.loads(self.progress.read_text())
        except (OSError, ValueError):
            return None
        return doc

    def wait_hung(self, step: int) -> int:
        """The trainer hung at ``step`` (``--hang-once-at``): its pid."""
        mark = self.dir / "hung" / f"hung-at-{step}"

        def hung() -> bool:
            assert self.loop is not None and self.loop.poll() is None, self.logs()
            doc = self.progress_doc()
            return doc is not None and doc["step"] == step and mark.exists()

        wait_until(hung, 120, f"the trainer hung at step {step}", interval=0.01)
        pid = int(self.pidfile.read_text())
        assert pid == step_log(self)[-1][0]
        return pid

    def logs(self) -> str:
        loop = (self.dir / "loop.log").read_text(errors="replace")[-3000:]
        return loop + (self.daemon.log_text()[-4000:] if self.daemon else "")

    def close(self) -> None:
        """Kill what is left (a failed test), by PID: the loop, its trainer, the daemon."""
        if self.loop is not None and self.loop.poll() is None:
            self.loop.kill()
            self.loop.wait()
        try:
            pid = int(self.pidfile.read_text())
        except (OSError, ValueError):
            pid = None
        if pid is not None and _alive(pid) and str(self.ckpt) in cmdline_of(pid):
            os.kill(pid, signal.SIGKILL)
        if self.daemon is not None:
            self.daemon.__exit__()


@pytest.mark.slow
def test_beside_ckptd_run_the_sidecar_counts_the_lost_steps_exactly(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """The same run as above, but each node is a pod: ``ckptd run`` beside a trainer that a
    plain loop restarts, the pod's init step (``ckptd restore --latest`` into the watch
    dir) on the fresh node, the notice the pod's SIGTERM to ckptd. The ledger the two
    sidecars kept counts each interruption's lost steps as the trainer's log does, its
    attempts are the trainer's starts, and it holds the init step's restore."""
    env = Env(s3_dest, local_s3.endpoint_url)
    first, second = SidecarNode(tmp_path / "node-a", env), SidecarNode(tmp_path / "node-b", env)
    try:
        daemon = first.start_daemon()
        loop = first.start_trainer_loop(*interruptions_as_planned(first.dir))
        for target in KILLED_AT:
            pid = first.wait_hung(target)
            os.kill(pid, signal.SIGKILL)  # the loop starts it again, from step-20
            wait_until(lambda p=pid: not _alive(p), 10, f"trainer {pid} gone")
        wait_until(
            lambda: (first.progress_doc() or {}).get("step") == NOTICE_AT,
            120,
            f"the trainer waiting for the notice at step {NOTICE_AT}",
            details=first.logs,
        )
        # The sidecar's own status and metrics carry the ledger as it stands.
        assert first.daemon is not None
        live = first.daemon.get_json("/v1/status")["goodput"]["run"]
        assert (live["attempts"], live["interruptions"], live["lost_steps"]) == (3, 2, 20), live
        assert 0 < first.daemon.metric("ckptd_goodput_ratio", run=RUN_ID) < 1
        daemon.send_signal(signal.SIGTERM)  # the pod's end: a notice
        assert loop.wait(timeout=90) == 0, first.logs()  # it saved on the notice, exit 0
        assert daemon.wait(timeout=90) == 0, first.logs()

        # The fresh node: the pod's init step restores into the watch dir, then the pod.
        dest = ["--dest", s3_dest, "--endpoint-url", local_s3.endpoint_url]
        restore_began = time.time()
        restored = run_cli(
            *("restore", "--run", RUN_ID, "--latest", "--to", str(second.ckpt), *dest),
            config=second.config,
        )
        assert restored.returncode == 0, restored.stderr
        daemon = second.start_daemon()
        loop = second.start_trainer_loop()
        assert loop.wait(timeout=180) == 0, second.logs()
        watcher = second.daemon
        assert watcher is not None
        wait_until(
            lambda: watcher.metric("ckptd_last_committed_step", run=RUN_ID) == SPEC.max_steps,
            60,
            "the last checkpoint committed",
        )
        daemon.send_signal(signal.SIGINT)  # a plain stop
        assert daemon.wait(timeout=60) == 0, second.logs()
    finally:
        first.close()
        second.close()

    storage = open_storage(s3_dest, endpoint_url=local_s3.endpoint_url)
    records = read_ledger(Repository(storage), RUN_ID)
    g = goodput(records)
    log = step_log(first, second)
    redone = redone_per_interruption(log)
    print(f"sidecar ledger: {g.to_json()}")
    print(
        f"re-done per the trainer's log: {redone}; the ledger's: "
        f"{[i.lost_steps for i in g.interruptions]}"
    )
    assert redone == [7, 13, 0], redone
    assert [i.lost_steps for i in g.interruptions] == redone
    assert [i.cause for i in g.interruptions] == ["trainer-gone", "trainer-gone", "notice"]
    assert g.attempts == len({pid for pid, _, _ in log}) == 4
    assert g.nodes == 1 and abs(sum(g.seconds.values()) - g.wall) <= 1e-6 * g.wall
    restore = [r for r in records if isinstance(r, Interval) and r.basis == "restore-record"]
    assert len(restore) == 1 and restore_began <= restore[0].start <= restore[0].end
    kinds = Counter(r.kind for r in records if isinstance(r, Mark))
    assert kinds["notice"] == 1 and kinds["stopped"] == 2 and kinds["finished"] == 0, kinds
    own = own_goodput(log, saves_reported(first, second), g.wall)
    print(f"goodput: the sidecars' ledger {g.ratio:.3f}, the trainer's log {own:.3f}")


@pytest.mark.slow
def test_beside_ckptd_run_a_drill_is_the_drills_time_not_a_trainer_gone(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """Issue 45: a drill under ``ckptd run`` showed in the report as an interruption with
    cause ``trainer-gone``. The trainer waits at step 40; ``ckptd drill`` signals it, it
    saves and exits, and the pod starts it again: the ledger says ``drill``, and the time
    from the drill's notice to that start is the drill's."""
    env = Env(s3_dest, local_s3.endpoint_url)
    node = SidecarNode(tmp_path / "node", env)
    try:
        daemon = node.start_daemon()
        loop = node.start_trainer_loop("--pause-at", str(NOTICE_AT))
        wait_until(
            lambda: (node.progress_doc() or {}).get("step") == NOTICE_AT,
            120,
            f"the trainer waiting at step {NOTICE_AT}",
            details=node.logs,
        )
        drilled = run_cli("drill", "--deadline", "90", config=node.config, timeout=150)
        assert drilled.returncode == 0, drilled.stdout + drilled.stderr
        assert loop.wait(timeout=90) == 0, node.logs()  # it saved on the drill, exit 0
        loop = node.start_trainer_loop()  # the pod starts it again: it resumes and ends
        assert loop.wait(timeout=180) == 0, node.logs()
        watcher = node.daemon
        assert watcher is not None
        wait_until(
            lambda: watcher.metric("ckptd_last_committed_step", run=RUN_ID) == SPEC.max_steps,
            60,
            "the last checkpoint committed",
        )
        daemon.send_signal(signal.SIGINT)
        assert daemon.wait(timeout=60) == 0, node.logs()
    finally:
        node.close()
    records = read_ledger(
        Repository(open_storage(s3_dest, endpoint_url=local_s3.endpoint_url)), RUN_ID
    )
    g = goodput(records)
    assert [i.cause for i in g.interruptions] == ["drill"], g.interruptions
    assert g.seconds.get("drill", 0) > 0, g.to_json()


# -- the HTML timeline in a real browser ----------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def two_node_ledger() -> list[Record]:
    """Two nodes: node-0 trains throughout but for a save; node-1 is killed, waits, restores
    and trains again; a notice and a commit on node-0."""
    t = 1_800_000_000.0

    def iv(rid: str, node: str, cause: str, a: float, b: float) -> Interval:
        return Interval(rid, node, "a1", cause, t + a, t + b, "test")

    return merge_records(
        [
            iv("1", "node-0", "startup", 0, 10),
            iv("2", "node-0", "productive", 10, 100),
            iv("3", "node-0", "save", 40, 45),
            iv("4", "node-1", "startup", 0, 12),
            iv("5", "node-1", "productive", 12, 50),
            iv("6", "node-1", "lost", 42, 50),
            iv("7", "node-1", "down", 50, 60),
            iv("8", "node-1", "restore", 60, 65),
            iv("9", "node-1", "productive", 65, 100),
            Mark("m1", "node-1", "a1", "interrupted", t + 50, "signal:SIGKILL", 38),
            Mark("m2", "node-0", "a1", "notice", t + 90, "aws"),
            Mark("m3", "node-0", "a1", "commit", t + 95, "step-90"),
        ]
    )


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium)")
def test_the_html_timeline_draws_lanes_and_markers_in_a_browser(tmp_path: Path) -> None:
    pytest.importorskip("plotly", reason="the report extra (plotly) is not installed")
    from ckptd.goodput.report import COLOURS, timeline_html

    records = two_node_ledger()
    page = tmp_path / "timeline.html"
    page.write_text(timeline_html("run1", records, goodput(records)))
    assert CHROMIUM is not None
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    # Drawn, not only written: the SVG plotly renders holds each cause's bars in its colour
    # (fill rgb(...)), both lanes' tick labels and the markers' points.
    assert 'class="main-svg"' in dom, dom[-2000:]
    for cause in ("productive", "save", "lost", "down", "restore", "startup"):
        r, g, b = (int(COLOURS[cause][i : i + 2], 16) for i in (1, 3, 5))
        assert f"fill: rgb({r}, {g}, {b})" in dom, f"no {cause} bar drawn"
    assert ">node-0<" in dom and ">node-1<" in dom, "a lane is missing"
    assert dom.count('class="point"') >= 13, "bars and markers: at least one point each"
    for kind in ("interrupted", "notice", "commit"):
        assert f">{kind}<" in dom, f"no {kind} in the legend"


# -- kill -9 of ckptd exec itself -----------------------------------------------------------


@pytest.mark.slow
def test_kill_9_of_exec_at_random_moments_never_loses_or_double_counts_a_record(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """``ckptd exec`` (and with it the node) killed at seeded random moments, restarted on
    the same state dir each time, then left to finish: every record its lives journaled is
    in the store, each id with one content, and nothing else is; the causes still sum to
    the wall time, the time no life journaled reading as unknown or down, not productive."""
    rng = random.Random(CAMPAIGN_SEED)
    node = ExecNode(tmp_path / "node", SPEC, Env(s3_dest, local_s3.endpoint_url))
    node.command = command(node.dir)
    kills = []
    try:
        for i in range(4):
            node.start()
            if i % 2 == 0:  # at a random moment: restoring, starting the trainer, shipping
                delay = rng.uniform(0.2, 3.0)
                kills.append(f"{delay:.2f} s after start")
                deadline = time.monotonic() + delay
                wait_until(lambda d=deadline: time.monotonic() >= d, delay + 5, "the moment")
            else:  # while training
                before = (node.progress_doc() or {}).get("step", 0)
                target = min(before + rng.randint(3, 15), SPEC.max_steps - 5)
                node.wait_progress(lambda d, t=target: d["step"] >= t, 120, f"step {target}")
                kills.append(f"at step {target}")
            # The node dies: ckptd exec and its trainer with it (frozen first, so that it
            # starts no trainer between the look at its children and the kill).
            assert node.proc is not None
            node.proc.send_signal(signal.SIGSTOP)
            for pid in process_tree(node.proc.pid):
                os.kill(pid, signal.SIGKILL)
            node.proc.wait()
            trainer = node.trainer_pid()
            if trainer is not None and _alive(trainer):
                os.kill(trainer, signal.SIGKILL)
            node.pidfile.unlink(missing_ok=True)
        node.start()
        assert node.wait_exit(180) == 0, node.log_tail()
    finally:
        node.close()
    print(f"seed {CAMPAIGN_SEED}: ckptd exec killed {kills}")

    journal = node.dir / "state" / "goodput" / f"{RUN_ID}.jsonl"
    journaled: dict[str, dict[str, object]] = {}
    for line in journal.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # a line torn by the kill is no record
        journaled[doc["id"]] = doc
    storage = open_storage(s3_dest, endpoint_url=local_s3.endpoint_url)
    copies: dict[str, list[dict[str, object]]] = {}
    for info in storage.list_objects(f"{RUN_ID}/GOODPUT."):
        for doc in json.loads(storage.get_bytes(info.key))["records"]:
            copies.setdefault(doc["id"], []).append(doc)
    assert set(copies) == set(journaled), "a journaled record is missing from the store"
    for rid, docs in copies.items():
        assert all(d == journaled[rid] for d in docs), f"{rid} differs between copies"
    records = read_ledger(Repository(storage), RUN_ID)
    g = goodput(records)
    assert len(records) == len(journaled)
    assert abs(sum(g.seconds.values()) - g.wall) <= 1e-6 * max(1.0, g.wall)
    assert sum(1 for r in records if isinstance(r, Mark) and r.kind == "finished") == 1
    # Productive never exceeds what the trainer's own log shows it spent stepping.
    log = step_log(node)
    assert g.seconds["productive"] <= log[-1][2] - log[0][2]
    # Each exec killed while training left an interruption (marked by its successor),
    # and the steps lost equal those really re-done: what its last journaled span missed
    # is taken from the step report its trainer left in the watch dir.
    gone = [i for i in g.interruptions if i.cause == "exec-gone"]
    assert 2 <= len(gone) <= 4, g.interruptions
    redone = sum(n - 1 for n in Counter(step for _, step, _ in log).values())
    assert sum(i.lost_steps or 0 for i in g.interruptions) == redone
    print(f"interruptions {len(gone)}, lost steps {g.to_json()['lost_steps']}, re-done {redone}")


# -- two nodes --------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_nodes_write_one_ledger(tmp_path: Path, local_s3: LocalS3, s3_dest: str) -> None:
    """``ckptd exec`` on two nodes (``[cluster]``), a notice on node 0 flushing both: the
    run's one ledger holds both nodes' lanes (their training, the notice each followed,
    the commit each waited for), and its causes sum to the wall time."""
    nodes = []
    for rank in (0, 1):
        directory = tmp_path / f"node-{rank}"
        trainer = [
            *(sys.executable, "-m", "tests.support.trainers.toy_preemptible"),
            *("--dir", str(directory / "run"), "--pidfile", str(directory / "trainer.pid")),
            *("--mib", "1", "--name", "checkpoint-999"),
            *(("--shard", "rng_state_1.pth", "--no-commit-record") if rank else ()),
        ]
        nodes.append(
            ExecNode(
                directory,
                SPEC,
                Env(s3_dest, local_s3.endpoint_url),
                command=trainer,
                extra_config=f"[cluster]\nnodes = 2\nnode_rank = {rank}\n"
                "poll_interval_seconds = 0.2\n",
            )
        )
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            progress = node.ckpt / ".progress"

            def trained(p: Path = progress) -> bool:
                return p.exists() and int(p.read_text() or 0) >= 50

            wait_until(trained, 60, f"{node.dir.name} 50 steps")
        nodes[0].signal(signal.SIGTERM)
        codes = [node.wait_exit(90) for node in nodes]
    finally:
        for node in nodes:
            node.close()
    assert codes == [0, 0], [node.log_tail() for node in nodes]

    storage = open_storage(s3_dest, endpoint_url=local_s3.endpoint_url)
    records = read_ledger(Repository(storage), RUN_ID)
    g = goodput(records)
    print(f"two nodes: {g.to_json()}")
    lanes = sorted({r.node for r in records})
    assert g.nodes == 2 and [lane[-2:] for lane in lanes] == ["#0", "#1"], lanes
    for lane in lanes:
        mine = [r for r in records if r.node == lane]
        assert any(isinstance(r, Interval) and r.cause == "productive" for r in mine), lane
        kinds = {r.kind for r in mine if isinstance(r, Mark)}
        assert {"notice", "commit", "interrupted"} <= kinds, (lane, kinds)
    assert abs(sum(g.seconds.values()) - g.wall) <= 1e-6 * max(1.0, g.wall)
    assert g.seconds["productive"] > 0 and g.seconds["startup"] > 0
