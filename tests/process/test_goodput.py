"""Goodput under ``ckptd exec``: a real trainer, killed (``kill -9``) once and preempted
(SIGTERM) once, then finished on a fresh node. The run ledger in the store is checked
against the trainer's own log of its steps (each line ``pid step time``):

- the lost steps it records equal the steps the trainer really did twice;
- its causes sum to the wall time within 2 %;
- its goodput is within 2 points of the test's own: the time the trainer spent on steps
  it kept (from its step timestamps) over the wall time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptd.devtools.locals3 import LocalS3
from ckptd.goodput.model import Interval, Mark, Record, goodput, merge_records
from ckptd.goodput.recorder import read_ledger
from ckptd.storage import open_storage
from ckptd.store.repository import Repository
from ckptd.supervision.supervisor import process_tree
from tests.support.daemon import run_cli, wait_until
from tests.support.exec_harness import ExecNode, _alive, trainer_command
from tests.support.harness import RUN_ID, Env, TrainerSpec

SEED = 20261204
# The kill -9 campaign's seed (GOODPUT_CAMPAIGN_SEED for another; not CKPTD_*: the daemon
# refuses an unknown CKPTD_ variable).
CAMPAIGN_SEED = int(os.environ.get("GOODPUT_CAMPAIGN_SEED", SEED + 1))
SPEC = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=90,
    save_every=10,
    step_delay=0.05,
    interruptions=2,
    checkpoint_name="step-{}",
)


def command(node_dir: Path) -> list[str]:
    # Every step reported (the default is at most every 5 s), so lost steps are exact.
    return [
        "env",
        "CKPTD_STEP_REPORT_SECONDS=0",
        *trainer_command(SPEC, node_dir),
        "--report-saves",
    ]


def step_log(*nodes: ExecNode) -> list[tuple[int, int, float]]:
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


def saves_reported(*nodes: ExecNode) -> list[tuple[float, float]]:
    """Each save the trainer reported: (at, save_seconds)."""
    out = []
    for node in nodes:
        for line in (node.ckpt / ".ckptd" / "saves.jsonl").read_text().splitlines():
            doc = json.loads(line)
            out.append((float(doc["at"]), float(doc["save_seconds"])))
    return out


@pytest.mark.slow
def test_the_ledger_matches_what_the_trainer_did(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    rng = random.Random(SEED)
    env = Env(s3_dest, local_s3.endpoint_url)
    first = ExecNode(tmp_path / "node-a", SPEC, env)
    first.command = command(first.dir)
    try:
        first.start()
        # kill -9 between two saves: the steps since the last one are re-done.
        target = 10 + rng.randint(2, 8)
        first.wait_progress(lambda d: d["step"] >= target, 120, f"step {target}")
        pid = first.trainer_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), 10, f"trainer {pid} gone")
        first.wait_progress(
            lambda d: first.trainer_pid() != pid and d["step"] >= 35, 120, "step 35 after restart"
        )
        live = first.get_json("/v1/status")["goodput"]["run"]
        assert live["interruptions"] == 1 and live["lost_steps"] > 0, live
        assert 0 < live["goodput_ratio"] < 1, live
        text = first.metrics_text()
        assert 0 < metric(text, "ckptd_goodput_ratio", run=RUN_ID) < 1
        assert metric(text, "ckptd_badput_seconds_total", run=RUN_ID, cause="lost") > 0
        first.signal(signal.SIGTERM)  # the notice: the emergency checkpoint, exit 0
        assert first.wait_exit(90) == 0, first.log_tail()
    finally:
        first.close()

    second = ExecNode(tmp_path / "node-b", SPEC, env)  # a fresh node continues the run
    second.command = command(second.dir)
    try:
        second.start()
        assert second.wait_exit(180) == 0, second.log_tail()
    finally:
        second.close()
    assert second.result_doc()["step"] == SPEC.max_steps

    storage = open_storage(s3_dest, endpoint_url=local_s3.endpoint_url)
    records = read_ledger(Repository(storage), RUN_ID)
    g = goodput(records)

    log = step_log(first, second)
    redone = sum(n - 1 for n in Counter(step for _, step, _ in log).values())
    lost_steps = sum(i.lost_steps or 0 for i in g.interruptions)
    print(f"ledger: {g.to_json()}")
    print(f"steps re-done per the trainer's log: {redone}; ledger: {lost_steps}")
    assert redone > 0
    assert lost_steps == redone
    kinds = Counter(r.kind for r in records if isinstance(r, Mark))
    assert kinds["interrupted"] == 2 and kinds["notice"] == 1 and kinds["finished"] == 1, kinds
    commits = {r.detail for r in records if isinstance(r, Mark) and r.kind == "commit"}
    assert first.result_doc()["saved"] in commits and f"step-{SPEC.max_steps}" in commits
    assert {r.cause for r in records if isinstance(r, Interval)} >= {"productive", "down"}

    # Causes sum to the wall time (the wall: first record to the run's end).
    assert abs(sum(g.seconds.values()) - g.wall) <= 0.02 * g.wall
    # The test's own goodput: per trainer process, the time from its first step to the
    # last step it did that no later process did again, less its saves (the trainer's own
    # save reports), over the wall time.
    by_pid: dict[int, list[tuple[int, float]]] = {}
    for pid_, step, at in log:
        by_pid.setdefault(pid_, []).append((step, at))
    pids = sorted(by_pid, key=lambda p: by_pid[p][0][1])
    spans = []
    for i, pid_ in enumerate(pids):
        steps = by_pid[pid_]
        last_kept = by_pid[pids[i + 1]][0][0] - 1 if i + 1 < len(pids) else steps[-1][0]
        times = [at for step, at in steps if step <= last_kept]
        spans.append((times[0], times[-1]))
    save_time = sum(
        min(at, hi) - max(at - seconds, lo)
        for at, seconds in saves_reported(first, second)
        for lo, hi in spans
        if at - seconds < hi and at > lo
    )
    kept = sum(hi - lo for lo, hi in spans) - save_time
    own = kept / g.wall
    print(f"goodput: ledger {g.ratio:.3f}, the test's own {own:.3f}; wall {g.wall:.1f} s")
    assert g.ratio is not None
    assert abs(g.ratio - own) <= 0.02
    assert g.seconds["lost"] > 0 and g.seconds["restore"] > 0 and g.seconds["startup"] > 0

    # ckptd report says the same, on the terminal and as JSON.
    dest = ["--dest", s3_dest, "--endpoint-url", local_s3.endpoint_url]
    page = tmp_path / "timeline.html"
    shown = run_cli("report", RUN_ID, *dest, "--html", str(page))
    assert shown.returncode == 0, shown.stderr
    assert page.stat().st_size > 0 and "Plotly.newPlot" in page.read_text()
    assert f"goodput {100 * g.ratio:.1f} %" in shown.stdout, shown.stdout
    assert "signal:SIGKILL" in shown.stdout and "lost" in shown.stdout, shown.stdout
    doc = json.loads(run_cli("report", RUN_ID, "--json", *dest).stdout)
    assert doc["goodput"]["lost_steps"] == redone
    assert doc["goodput"]["goodput_ratio"] == pytest.approx(g.ratio, abs=1e-3)


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
            *("env", "CKPTD_STEP_REPORT_SECONDS=0"),
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
