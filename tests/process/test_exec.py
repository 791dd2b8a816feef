"""``ckptd exec``: the daemon with a real trainer as its supervised child.

- a trainer killed (``kill -9``) again and again at seeded random steps is restarted each
  time from the newest complete checkpoint and ends bit-identical to an uninterrupted run,
  with the restarts counted (status, metrics) and fewer steps lost per crash than a save
  interval;
- SIGTERM mid-training: the trainer's emergency checkpoint is committed, exit 0; a fresh
  node then restores it and resumes from that very step (time to first step printed);
- SIGTERM with the store unreachable: exit 75 (emergency checkpoint not committed);
- a cloud's notice (the fake EC2 metadata service) ends it as SIGTERM does;
- a trainer that fails at start-up is given up on after 3 attempts: exit 76;
- bad usage exits 2 with one line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptd.core.errors import EXIT_FLUSH_FAILED, EXIT_GAVE_UP
from ckptd.devtools.locals3 import LocalS3
from ckptd.runtime.processes import catches_signal
from ckptd.supervision.supervisor import process_tree, signal_targets
from tests.support.daemon import read_pid, run_cli, wait_until
from tests.support.exec_harness import ExecNode, _alive, crash_repeatedly
from tests.support.fakes.aws_imds import FakeAwsImds
from tests.support.faultproxy import FaultProxy
from tests.support.harness import (
    RUN_ID,
    Env,
    TrainerSpec,
    compare_weights,
    finish_reference,
    start_reference,
)

SEED = 20261203
# Kills per trainer (6 in the default run; EXEC_CRASHES=30 for a longer one). Not CKPTD_*:
# the daemon refuses an unknown CKPTD_ variable, and its trainer inherits this one.
CRASHES = int(os.environ.get("EXEC_CRASHES", "6"))
# Each crash advances at most 2 save intervals, then the last attempt runs to the end.
MAX_STEPS = 10 * (2 * CRASHES + 3)

PLAIN_EXEC = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=MAX_STEPS,
    save_every=10,
    step_delay=0.02,
    interruptions=CRASHES,
    checkpoint_name="step-{}",
)
HF_EXEC = TrainerSpec(
    name="hf-trainer",
    module="tests.support.trainers.hf_gpt2",
    max_steps=MAX_STEPS,
    save_every=10,
    step_delay=0.0,  # a Trainer step already takes ~20 ms here
    interruptions=CRASHES,
    checkpoint_name="checkpoint-{}",
)
SHORT = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=60,
    save_every=10,
    step_delay=0.05,
    interruptions=1,
    checkpoint_name="step-{}",
)


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


@pytest.mark.slow
@pytest.mark.parametrize("spec", [PLAIN_EXEC, HF_EXEC], ids=lambda s: s.name)
def test_a_trainer_killed_again_and_again_ends_bit_identical(
    spec: TrainerSpec, tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    reference = start_reference(spec, tmp_path)
    node = ExecNode(
        tmp_path / "node", spec, Env(s3_dest, local_s3.endpoint_url), max_restarts=CRASHES + 5
    )
    try:
        node.start()
        crashes = crash_repeatedly(node, CRASHES, rng, timeout=120)
        status = node.get_json("/v1/status")["trainer"]
        metrics = node.metrics_text()
        assert node.wait_exit(240) == 0, node.log_tail()
    finally:
        node.close()
    ref_final, _ = finish_reference(spec, reference)

    print("| crash | last step | resumed | steps lost | kill -> first step s |")
    for i, c in enumerate(crashes, 1):
        print(f"| {i} | {c.last_step} | {c.resumed_step} | {c.steps_lost} | {c.restart_s:.2f} |")
    assert len(crashes) == CRASHES
    previous = 0
    for c in crashes:
        # Resumed from a save of this attempt or later (progress), never from a step it
        # had not finished, and losing at most one save interval.
        assert c.resumed_step % spec.save_every == 0, c
        assert c.resumed_step >= previous + spec.save_every, c
        assert 0 <= c.steps_lost <= spec.save_every, c
        previous = c.resumed_step
    assert status["restarts"] == CRASHES and status["starts"] == CRASHES + 1, status
    assert status["last_exit"]["cause"] == "signal:SIGKILL", status
    assert status["pid"] is not None and status["gave_up"] is None, status
    assert metric(metrics, "ckptd_trainer_restarts_total", run=RUN_ID, cause="signal:SIGKILL") == (
        CRASHES
    )
    assert metric(metrics, "ckptd_trainer_restart_seconds_count", run=RUN_ID) == CRASHES
    restarted = node.events("trainer_restarted")
    assert len(restarted) == CRASHES
    print("crash seen -> trainer started, s:", [e["seconds_since_crash"] for e in restarted])
    assert node.result_doc()["step"] == spec.max_steps
    mismatched = compare_weights(ref_final, node.final)
    assert not mismatched, f"final weights differ from the reference: {mismatched[:5]}"


@pytest.mark.slow
def test_sigterm_commits_the_emergency_checkpoint_and_a_fresh_node_resumes_there(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    env = Env(s3_dest, local_s3.endpoint_url)
    reference = start_reference(SHORT, tmp_path)
    first = ExecNode(tmp_path / "node-a", SHORT, env)
    try:
        first.start()
        first.wait_progress(lambda d: d["step"] >= 25, 120, "step 25")
        first.signal(signal.SIGTERM)
        code = first.wait_exit(90)
    finally:
        first.close()
    result = first.result_doc()
    saved = result["saved"]
    assert code == 0, first.log_tail()
    assert result["preempted"] and saved == f"step-{result['step']}", result
    # Committed (the emergency checkpoint jumps the queue: older ones may follow it).
    assert saved in [e["checkpoint"] for e in first.events("checkpoint_committed")]
    (preempted,) = first.events("exec_preempted")
    assert preempted["committed"] is True and preempted["emergency_checkpoint"] == saved

    second = ExecNode(tmp_path / "node-b", SHORT, env)  # a fresh node: empty directory
    try:
        second.start()
        doc = second.wait_progress(lambda d: True, 120, "the resumed trainer's first step")
        first_step_s = doc["first_step_at"] - second.started_wall
        (restored,) = second.events("exec_restored")
        code = second.wait_exit(120)
    finally:
        second.close()
    print(
        f"fresh node: restored {restored['checkpoint']} in {restored['seconds']:.2f} s; "
        f"first resumed step {first_step_s:.2f} s after `ckptd exec` started"
    )
    assert code == 0, second.log_tail()
    assert restored["checkpoint"] == saved
    assert doc["resumed_from"] == result["step"]  # 0 steps lost
    assert 0 < first_step_s < 120
    (started,) = second.events("trainer_started")
    assert started["resume_from"] == str(second.ckpt / saved)
    ref_final, _ = finish_reference(SHORT, reference)
    assert not compare_weights(ref_final, second.final)


@pytest.mark.slow
def test_a_second_notice_during_the_flush_does_not_undo_it(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """SIGTERM, then Ctrl-C's SIGINT while the emergency checkpoint is being made: one
    flush, committed, exit 0, and the second notice logged as ignored. (It once replaced
    the response the flush waited on, when it came before the flush read it: exec then gave
    up with 75 although the checkpoint was committed; that race is timing-dependent, the
    log line is not.)"""
    node = ExecNode(tmp_path / "node", SHORT, Env(s3_dest, local_s3.endpoint_url))
    try:
        node.start()
        node.wait_progress(lambda d: d["step"] >= 3, 120, "step 3")
        node.signal(signal.SIGTERM)
        node.signal(signal.SIGINT)
        code = node.wait_exit(90)
    finally:
        node.close()
    saved = node.result_doc()["saved"]
    assert code == 0, node.log_tail()
    assert saved in [e["checkpoint"] for e in node.events("checkpoint_committed")]
    assert node.events("notice_ignored_already_responding"), node.log_tail()


@pytest.mark.slow
def test_sigterm_with_the_store_unreachable_exits_75(
    tmp_path: Path, fault_proxy: FaultProxy, s3_dest: str
) -> None:
    node = ExecNode(tmp_path / "node", SHORT, Env(s3_dest, fault_proxy.url), shutdown_timeout=8)
    try:
        node.start()
        node.wait_progress(lambda d: d["step"] >= 3, 120, "step 3")
        fault_proxy.set_faults(rate=1.0, kinds=("reset",))
        node.signal(signal.SIGTERM)
        code = node.wait_exit(90)
    finally:
        node.close()
    saved = node.result_doc()["saved"]
    assert code == EXIT_FLUSH_FAILED, node.log_tail()
    assert saved is not None and (node.ckpt / saved / ".metadata").exists()  # saved locally
    assert saved not in [e["checkpoint"] for e in node.events("checkpoint_committed")]
    (preempted,) = node.events("exec_preempted")
    assert preempted["committed"] is False


@pytest.mark.slow
def test_a_cloud_notice_acts_as_sigterm_does(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    imds = FakeAwsImds()
    url = imds.start_in_thread()
    node = ExecNode(
        tmp_path / "node",
        SHORT,
        Env(s3_dest, local_s3.endpoint_url),
        preemption=f'provider = "aws"\nendpoint = "{url}"\npoll_interval_seconds = 0.2',
    )
    try:
        node.start()
        node.wait_progress(lambda d: d["step"] >= 5, 120, "step 5")
        imds.trigger_spot("terminate")
        code = node.wait_exit(90)
    finally:
        node.close()
        imds.stop_thread()
    saved = node.result_doc()["saved"]
    assert code == 0, node.log_tail()
    (notice,) = node.events("notice_received")
    assert notice["source"] == "aws"
    assert saved in [e["checkpoint"] for e in node.events("checkpoint_committed")]
    assert len(node.events("trainer_started")) == 1  # stopped, not restarted
    (preempted,) = node.events("exec_preempted")  # the notice path, as after SIGTERM
    assert preempted["committed"] is True and preempted["emergency_checkpoint"] == saved


def _quick_node(tmp_path: Path, command: list[str], max_restarts: int = 10) -> ExecNode:
    return ExecNode(
        tmp_path / "node",
        SHORT,
        Env(f"file://{tmp_path / 'store'}", ""),
        max_restarts=max_restarts,
        command=command,
    )


def test_a_trainer_failing_at_start_up_is_given_up_after_3_attempts(tmp_path: Path) -> None:
    node = _quick_node(tmp_path, [sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        started = time.monotonic()
        code = node.start().wait_exit(60)
        took = time.monotonic() - started
    finally:
        node.close()
    assert code == EXIT_GAVE_UP, node.log_tail()
    assert len(node.events("trainer_started")) == 3
    (given_up,) = node.events("trainer_given_up")
    assert "start-up 3 times" in given_up["reason"]
    assert [e["restart_in"] for e in node.events("trainer_exited")] == [1.0, 2.0, None]
    assert took >= 3.0  # the backoff was waited


def test_max_restarts_0_passes_the_trainer_code_through(tmp_path: Path) -> None:
    node = _quick_node(tmp_path, [sys.executable, "-c", "import sys; sys.exit(3)"], 0)
    try:
        assert node.start().wait_exit(60) == 3, node.log_tail()
    finally:
        node.close()
    assert len(node.events("trainer_started")) == 1


def test_the_trainer_gets_its_environment_and_its_own_code_is_the_exit_code(
    tmp_path: Path,
) -> None:
    # A complete checkpoint already on the node (a rerun): resumed from, not restored over.
    (tmp_path / "node" / "run" / "step-7").mkdir(parents=True)
    (tmp_path / "node" / "run" / "step-7" / "weights").write_text("w")
    (tmp_path / "node" / "run" / "step-7" / "COMPLETE").write_text("")
    script = (
        "import json, os, sys; "
        "json.dump({k: os.environ.get(k) for k in "
        "('CKPTD_RESUME_FROM', 'CKPTD_RUN', 'CKPTD_WATCH_DIR', 'CKPTD_SIGNAL', 'CKPTD_URL')}, "
        "open('env.json', 'w')); sys.exit(0)"
    )
    node = _quick_node(tmp_path, [sys.executable, "-c", script])
    node.config.write_text(
        node.config.read_text().replace("settle_seconds", 'layout = "marker"\nsettle_seconds')
    )
    try:
        assert node.start().wait_exit(60) == 0, node.log_tail()
    finally:
        node.close()
    env = json.loads((node.dir / "env.json").read_text())
    assert env == {
        "CKPTD_RESUME_FROM": str(node.ckpt / "step-7"),
        "CKPTD_RUN": RUN_ID,
        "CKPTD_WATCH_DIR": str(node.ckpt),
        "CKPTD_SIGNAL": "SIGUSR1",
        "CKPTD_URL": f"http://127.0.0.1:{node.port}/v1/preemption",
    }
    # No SIGTERM came: the log says what ended it (the trainer) and nothing about a flush.
    assert node.events("flushed_after_trainer_exit")
    assert not node.events("flushed_on_sigterm")


def test_a_typod_destination_starts_from_scratch_with_a_warning_naming_what_is_beside_it(
    tmp_path: Path,
) -> None:
    """``--dest file://.../pro`` beside ``.../prod`` (which holds runs) read as a new run,
    with only an info line: the trainer still starts from scratch (a new run is
    legitimate), but the warning names the prefix that holds runs."""
    (tmp_path / "stores" / "prod" / "run1" / "checkpoint-5").mkdir(parents=True)
    typo = tmp_path / "stores" / "pro"
    node = ExecNode(
        tmp_path / "node",
        SHORT,
        Env(typo.as_uri(), ""),
        command=[sys.executable, "-c", "import os, sys; sys.exit(0)"],
    )
    try:
        assert node.start().wait_exit(60) == 0, node.log_tail()
    finally:
        node.close()
    (event,) = node.events("exec_nothing_to_restore")
    assert event["level"] == "warning", event
    assert event["hint"] == f"{typo.as_uri()} holds no run; beside it: {typo.as_uri()}d", event
    assert len(node.events("trainer_started")) == 1  # from scratch all the same


def test_a_trainer_left_by_an_exec_killed_with_9_is_ended_by_the_next_exec(
    tmp_path: Path,
) -> None:
    # The trainer runs in its own session: kill -9 of its exec does not reach it. The next
    # exec on the node must end it (and its launcher's children) before starting another.
    script = (
        "import os, subprocess, time; "
        "child = subprocess.Popen(['sleep', '600']); "
        "open('trainer.pid', 'w').write(str(os.getpid())); "
        "open('child.pid', 'w').write(str(child.pid)); time.sleep(600)"
    )
    first = _quick_node(tmp_path, [sys.executable, "-c", script])
    pids: list[int] = []
    try:
        first.start()
        state = first.dir / "state" / "trainer.json"
        child = first.dir / "child.pid"
        child_pid = wait_until(
            lambda: state.exists() and read_pid(child),
            60,
            "the trainer and its child started",
            details=first.log_tail,
        )
        pids = [first.trainer_pid() or 0, child_pid]
        assert first.proc is not None
        first.proc.kill()
        first.proc.wait()
        time.sleep(0.5)
        assert all(_alive(pid) for pid in pids)  # left behind, as the kernel does
        second = _quick_node(tmp_path, [sys.executable, "-c", "print('the new trainer')"])
        assert second.start().wait_exit(60) == 0, second.log_tail()
        (killed,) = second.events("trainer_leftover_killed")
        assert sorted(killed["pids"]) == sorted(pids)
        assert not any(_alive(pid) for pid in pids)
        # One log for both: the first exec's start, then the second's, only once.
        started = second.events("trainer_started")
        assert len(started) == 2 and started[1]["pid"] not in pids
        assert not state.exists()  # the new trainer ended: nothing is named any more
    finally:
        first.close()
        for pid in pids:
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_bad_usage_exits_2_with_one_line(tmp_path: Path) -> None:
    dest = f"file://{tmp_path / 'store'}"
    no_cmd = run_cli("exec", "--watch", str(tmp_path / "w"), "--dest", dest)
    assert no_cmd.returncode == 2 and "no trainer command" in no_cmd.stderr
    assert "Traceback" not in no_cmd.stderr
    cfg = tmp_path / "two.toml"
    cfg.write_text(
        f'[[watch]]\ndir = "{tmp_path / "a"}"\n[[watch]]\ndir = "{tmp_path / "b"}"\n'
        f'[destination]\nurl = "{dest}"\n'
    )
    two = run_cli("exec", "--config", str(cfg), "--", "true")
    assert two.returncode == 2 and "watch" in two.stderr and "exactly one" in two.stderr
    missing = run_cli(
        "exec",
        "--watch",
        str(tmp_path / "w"),
        "--dest",
        dest,
        "--state-dir",
        str(tmp_path / "s"),
        "--",
        str(tmp_path / "no-such-trainer"),
        env={"CKPTD_METRICS__LISTEN": "127.0.0.1:0"},
    )
    assert missing.returncode == 2 and "cannot run the trainer" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr
    helped = run_cli("exec", "--help")
    assert f"{EXIT_FLUSH_FAILED} " in helped.stdout and f"{EXIT_GAVE_UP} " in helped.stdout


def test_process_tree_holds_the_trainer_and_its_descendants() -> None:
    proc = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        tree = wait_until(lambda: len(t := process_tree(proc.pid)) == 3 and t, 10, "2 children")
        assert tree[0] == proc.pid and os.getpid() not in tree
    finally:
        for pid in reversed(process_tree(proc.pid)):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_notice_signals_the_ranks_that_catch_it_and_spares_the_launcher(
    tmp_path: Path,
) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tests.support.trainers.launcher_like", str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        for i in (0, 1):
            wait_until((tmp_path / f"rank{i}.ready").exists, 20, f"rank {i} ready")
        ranks = process_tree(launcher.pid)[1:]
        assert len(ranks) == 2
        # torchrun's shape: SIGTERM handled, SIGUSR1 not (it would die of it).
        assert catches_signal(launcher.pid, signal.SIGTERM)
        assert not catches_signal(launcher.pid, signal.SIGUSR1)
        targets = signal_targets(launcher.pid, signal.SIGUSR1)
        assert sorted(targets) == sorted(ranks)
        # With trainer.match, the command line decides instead.
        (matched,) = signal_targets(launcher.pid, signal.SIGUSR1, match="--rank 0")
        assert matched in ranks
        for pid in targets:
            os.kill(pid, signal.SIGUSR1)
        # The ranks saw it and ended; the launcher lived to collect them and exit 0.
        assert launcher.wait(timeout=20) == 0
        assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == "SIGUSR1"
    finally:
        if launcher.poll() is None:
            for pid in reversed(process_tree(launcher.pid)):
                os.kill(pid, signal.SIGKILL)
            launcher.wait()


def test_a_trainer_that_catches_nothing_yet_is_signalled_itself() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert signal_targets(proc.pid, signal.SIGUSR1) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()


def test_exec_on_two_nodes_a_sigterm_on_one_flushes_both(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """``ckptd exec`` with ``[cluster]``: SIGTERM to node 0's exec is published as the
    run's NOTICE; node 1's exec follows it, its trainer saves its share under the same
    name, the two parts commit as one checkpoint, and both execs exit 0 (flushed)."""
    nodes = []
    for rank in (0, 1):
        directory = tmp_path / f"node-{rank}"
        command = [
            *(sys.executable, "-m", "tests.support.trainers.toy_preemptible"),
            *("--dir", str(directory / "run"), "--pidfile", str(directory / "trainer.pid")),
            *("--mib", "1", "--name", "checkpoint-999"),
            # Node 0 holds the HF commit record and the weights; node 1 one more shard.
            *(("--shard", "rng_state_1.pth", "--no-commit-record") if rank else ()),
        ]
        nodes.append(
            ExecNode(
                directory,
                SHORT,
                Env(s3_dest, local_s3.endpoint_url),
                command=command,
                extra_config=f"[cluster]\nnodes = 2\nnode_rank = {rank}\n"
                "poll_interval_seconds = 0.2\n",
            )
        )
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            wait_until((node.ckpt / ".progress").exists, 60, f"{node.dir.name} training")
        nodes[0].signal(signal.SIGTERM)
        codes = [node.wait_exit(90) for node in nodes]
    finally:
        for node in nodes:
            node.close()
    assert codes == [0, 0], [node.log_tail() for node in nodes]
    (followed,) = nodes[1].events("notice_received")
    assert followed["source"].startswith("node-0/")
    for node in nodes:
        (preempted,) = node.events("exec_preempted")
        assert preempted["committed"] is True, node.log_tail()
        assert preempted["emergency_checkpoint"] == "checkpoint-999"
    # One notice in the store, node 0's: node 1 followed it and did not echo it back.
    assert len(nodes[0].events("cluster_notice_published")) == 1
    assert nodes[1].events("cluster_notice_published") == []
    assert len(nodes[0].events("notice_received")) == 1
    listed = run_cli("list", "--dest", s3_dest, "--endpoint-url", local_s3.endpoint_url, "--json")
    assert listed.returncode == 0, listed.stderr
    (checkpoint,) = json.loads(listed.stdout)["checkpoints"]
    assert checkpoint["checkpoint"] == "checkpoint-999"
    # The one checkpoint holds both nodes' shares, read back and checked.
    verified = run_cli(
        *("verify", "--dest", s3_dest, "--endpoint-url", local_s3.endpoint_url),
        *("--run", "run", "--latest", "--json"),
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert checkpoint["files"] == 3, checkpoint  # weights + trainer_state, and node 1's shard
