"""The drill with real processes against the session's SeaweedFS (docs/preemption.md, "The
drill"):

- a daemon with a short ``[drill] every`` drills by itself, the whole way: a real PyTorch
  trainer (CPU) is signalled and saves, the checkpoint is committed, restored into the
  scratch dir, verified, and loaded by a check that calls the trainer's own load
  function; each stage's time is in the record in the store, the metrics and ``ckptd
  status``, and the scratch dir is gone after;
- the restore-only drill (a fresh node, no daemon) fails at "verified" when one object in
  the store was replaced, and at "loaded" when the load check exits 1: exit 1, the stage
  named, the failure recorded beside the run;
- two daemons of one run with ``[cluster]``: one drill per period, not two;
- under ``ckptd exec`` the trainer that saved and stopped for a drill is started again at
  once from the drill's checkpoint, and exec goes on (a drill is not the run's end).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.drill.model import parse_record
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.exec_harness import ExecNode
from tests.support.harness import Env, TrainerSpec
from tests.support.writers import write_bytes

BUCKET = "ckpt"


def drill_records(s3: Any, prefix: str, run: str) -> list[dict[str, Any]]:
    """Every drill record of ``run`` in the store, as its bytes say, oldest first."""
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/{run}/DRILL.")
    keys = sorted(o["Key"] for o in listed.get("Contents", []))
    out = []
    for key in keys:
        body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert parse_record(body) is not None, key  # every one a valid record
        out.append(json.loads(body))
    return out


def add_toml(daemon: Daemon, text: str) -> None:
    daemon.config.write_text(daemon.config.read_text() + text)


def test_a_scheduled_drill_goes_the_whole_way_to_a_trainer_that_loads_its_checkpoint(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    scratch = tmp_path / "scratch"
    loaded = tmp_path / "loaded.txt"
    pidfile = tmp_path / "trainer.pid"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.trainers.tiny_torch",
            "--dir",
            str(root),
            "--pidfile",
            str(pidfile),
        ],
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: (root / ".progress").exists(), 60, "the trainer training")
        daemon = Daemon.configured(
            tmp_path,
            watch=[{"dir": root, "run_id": "run1", "layout": "marker"}],
            dest=s3_dest,
            endpoint_url=local_s3.endpoint_url,
            state_dir=tmp_path / "state",
        )
        daemon.env = {"CKPTD_PREEMPTION__SIGTERM": "stop"}  # the test's stop is no notice
        check = [sys.executable, "-m", "tests.support.trainers.load_check", "--report", loaded]
        add_toml(
            daemon,
            f'[trainer]\npidfile = "{pidfile}"\n'
            # Every 5 s, due within its first half second: the first drill within ~6 s
            # (the next fails for want of a trainer, 30 s later: after this test).
            '[drill]\nevery = "5s"\njitter = 0.1\nmargin_seconds = 0\ndeadline_seconds = 30\n'
            f"check = {json.dumps([str(a) for a in check])}\n"
            f'scratch_dir = "{scratch}"\n',
        )
        with daemon:
            (record,) = wait_until(
                lambda: drill_records(s3_client, s3_prefix, "run1"),
                60,
                "the scheduled drill's record",
                interval=0.2,
                details=lambda: daemon.log_text()[-3000:],
            )
            assert record["result"] == "success", record
            assert (record["kind"], record["trigger"]) == ("full", "schedule")
            saved = (root / ".saved").read_text()
            assert record["checkpoint"] == saved and record["failed_stage"] is None
            stages = {s["stage"]: s for s in record["stages"]}
            assert list(stages) == [
                "signalled",
                "complete",
                "committed",
                "restored",
                "verified",
                "loaded",
            ]
            assert all(s["status"] == "ok" and s["seconds"] >= 0 for s in stages.values())
            # The check loaded, with the trainer's own code, the restored copy (under the
            # scratch dir), not the trainer's local one; that copy is gone now.
            step, path = loaded.read_text().split(" ", 1)
            assert int(step) == int(saved.split("-")[1])
            assert Path(path).name == saved and Path(path).is_relative_to(scratch)
            assert list(scratch.iterdir()) == []
            assert trainer.wait(timeout=30) == 0  # it saved and stopped, as told

            # The metrics and `ckptd status` carry the same result and stage timings.
            metrics = daemon.metrics()
            labels = (("result", "success"), ("run", "run1"))
            assert metrics[("ckptd_drills_total", labels)] == 1
            last = metrics[("ckptd_drill_last_success_timestamp_seconds", (("run", "run1"),))]
            assert last == record["finished"]
            for name, stage in stages.items():
                key = ("ckptd_drill_stage_seconds", (("run", "run1"), ("stage", name)))
                assert round(metrics[key], 3) == stage["seconds"], name
            shown = run_cli("status", config=daemon.config)
            assert shown.returncode == 0, shown.stderr
            text = " ".join(shown.stdout.split())  # rich wraps long lines
            assert "drills: run1: 1 of the last 1 passed" in text, shown.stdout
            assert f"loaded {stages['loaded']['seconds']:.3f} s" in text, shown.stdout
            doc = daemon.get_json("/v1/status")["drills"]["run1"]
            assert doc["last"]["stages"] == record["stages"]
            assert daemon.stop() == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_a_restore_only_drill_fails_at_verified_for_a_replaced_object_and_at_loaded_for_a_failed_check(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    watch = tmp_path / "run1"
    write_bytes(watch / "step-5" / "model.bin", 256 * 1024)
    (watch / "step-5" / "COMPLETE").write_text("5")
    store = ["--dest", s3_dest, "--endpoint-url", local_s3.endpoint_url]
    shipped = run_cli(
        "run", "--once", "--watch", str(watch), "--layout", "marker",
        "--state-dir", str(tmp_path / "state"), *store,
    )  # fmt: skip
    assert shipped.returncode == 0, shipped.stderr
    scratch = tmp_path / "scratch"
    drill = ["drill", "--restore-only", "--run", "run1", "--scratch", str(scratch), *store]

    # The load check exits 1: the checkpoint restored and verified, not loaded.
    refused = run_cli(*drill, "--check", f"{sys.executable} -c 'import sys; sys.exit(1)'")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "result: FAILED at loaded: the load check exited 1" in refused.stdout
    assert "verified" in refused.stdout and "FAILED at verified" not in refused.stdout

    # One object replaced in the store by as many other bytes: the restore's check finds
    # it, and the drill fails at verified, naming the file; nothing is loaded.
    key = f"{s3_prefix}/run1/step-5/model.bin"
    s3_client.put_object(Bucket=BUCKET, Key=key, Body=b"\0" * (256 * 1024))
    corrupt = run_cli(*drill, "--check", f"{sys.executable} -c 'pass'")
    assert corrupt.returncode == 1, corrupt.stdout + corrupt.stderr
    (verdict,) = [ln for ln in corrupt.stdout.splitlines() if ln.startswith("result:")]
    assert verdict.startswith("result: FAILED at verified: ") and "model.bin" in verdict
    assert "the load check" not in corrupt.stdout  # never run on bytes that do not verify

    # Each drill recorded beside the run, as it ended; nothing left in the scratch dir.
    records = drill_records(s3_client, s3_prefix, "run1")
    assert [(r["kind"], r["failed_stage"]) for r in records] == [
        ("restore-only", "loaded"),
        ("restore-only", "verified"),
    ]
    assert [s["status"] for s in records[1]["stages"]] == ["ok", "failed", "not_reached"]
    assert "model.bin: crc32c" in records[1]["error"], records[1]
    assert list(scratch.iterdir()) == []
    reported = run_cli("report", "run1", "--json", *store)
    assert json.loads(reported.stdout)["drills"] | {"last": None} == {
        "drills": 2,
        "passed": 0,
        "success_rate": 0.0,
        "last_success": None,
        "last_failure": records[1]["finished"],
        "resumes": 0,
        "resumes_passed": 0,
        "resume_success_rate": None,
        "last_resume_success": None,
        "last": None,
    }


def test_two_daemons_of_one_run_make_one_drill_per_period(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    daemons = []
    for rank in (0, 1):
        node = tmp_path / f"node-{rank}"
        (node / "run").mkdir(parents=True)
        daemon = Daemon.configured(
            node,
            name=f"ckptd-{rank}",
            watch=[{"dir": node / "run", "run_id": "run"}],
            dest=s3_dest,
            endpoint_url=local_s3.endpoint_url,
            state_dir=node / "state",
        )
        # No trainer: each drill fails at "signalled" after its 1 s deadline, and is
        # recorded all the same; what counts here is how many there are.
        add_toml(daemon, '[drill]\nevery = "3s"\njitter = 0\ndeadline_seconds = 1\n')
        daemon.env = {
            "CKPTD_CLUSTER__NODES": "2",
            "CKPTD_CLUSTER__NODE_RANK": str(rank),
            "CKPTD_CLUSTER__POLL_INTERVAL_SECONDS": "0.2",
        }
        daemons.append(daemon)
    with daemons[0], daemons[1]:
        wait_until(
            lambda: len(drill_records(s3_client, s3_prefix, "run")) >= 2,
            60,
            "two periods' drills",
            interval=0.2,
            details=lambda: daemons[0].log_text()[-2000:] + daemons[1].log_text()[-2000:],
        )

        def counted() -> list[float]:
            return [d.metric("ckptd_drills_total", run="run", result="failure") for d in daemons]

        counts = wait_until(lambda: sum(counted()) >= 2 and counted(), 10, "drills counted")
        assert [d.stop() for d in daemons] == [0, 0]
    records = drill_records(s3_client, s3_prefix, "run")
    started = Counter(e["period"] for d in daemons for e in d.events_named("drill_starting"))
    periods = Counter(r["period"] for r in records)
    assert len(periods) >= 2
    assert set(periods.values()) == {1}, periods  # one record per period
    assert set(started.values()) == {1}, started  # one node started each
    assert all(r["failed_stage"] == "signalled" for r in records)
    assert sum(counts) >= 2  # counted where they ran
    # The other node knew it was not its turn: the claim was taken, or it was already
    # following the drill's cluster NOTICE.
    waited = [e for d in daemons for e in d.events_named("drill_claimed_elsewhere")] + [
        e for d in daemons for e in d.events_named("drill_skipped")
    ]
    assert waited


def test_a_daemon_whose_run_saves_more_often_than_the_margin_drills_every_period(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    """Issue 45, as it was seen: a run saving every second, advised every 60 s, under the
    default 600 s margin: its advised next save is always within the margin, and the
    daemon used to skip every period (no DRILL record, ``drill_skipped`` again at each
    flip of the reason). Now each period's drill starts, right after a routine save."""
    root = tmp_path / "run"
    root.mkdir()
    stop = threading.Event()

    def trainer() -> None:  # a routine save every second (no process to signal)
        step = 0
        while not stop.wait(1.0):
            step += 1
            write_bytes(root / f"step-{step}" / "model.bin", 4096)
            (root / f"step-{step}" / "COMPLETE").write_text(str(step))

    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": root, "run_id": "run1", "layout": "marker"}],
        dest=s3_dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=tmp_path / "state",
    )
    daemon.env = {"CKPTD_PREEMPTION__SIGTERM": "stop"}  # the test's stop is no notice
    # Periods of 8 s, the margin left at its default (600 s), the advice at most 60 s.
    add_toml(
        daemon,
        "[cadence]\nmax_interval_seconds = 60\n"
        '[drill]\nevery = "8s"\njitter = 0.1\ndeadline_seconds = 2\n',
    )
    writer = threading.Thread(target=trainer, daemon=True)
    writer.start()
    try:
        with daemon:
            records = wait_until(
                lambda: (r := drill_records(s3_client, s3_prefix, "run1")) and len(r) >= 3 and r,
                45,
                "three periods' drills",
                interval=0.5,
                details=lambda: daemon.log_text()[-3000:],
            )
            advised = daemon.metric("ckptd_advised_checkpoint_interval_seconds", run="run1")
            assert advised <= 60 < 600, advised
            assert daemon.metric("ckptd_drill_periods_missed", run="run1") == 0
            assert daemon.stop() == 0
    finally:
        stop.set()
        writer.join()
    periods = [r["period"] for r in records]
    assert len(set(periods)) == len(periods), periods  # one drill a period
    skipped = Counter(e["due"] for e in daemon.events_named("drill_skipped"))
    assert set(skipped.values()) <= {1}, skipped  # once per due time


def test_under_exec_the_trainer_stopped_by_a_drill_starts_again_from_its_checkpoint(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    home = tmp_path / "node"
    toy = "tests.support.trainers.toy_preemptible"
    command = [sys.executable, "-m", toy, "--dir", str(home / "run"), "--mib", "1"]
    spec = TrainerSpec("toy", toy, 0, 0, 0.0, 0, "checkpoint-{}")
    node = ExecNode(
        home,
        spec,
        Env(s3_dest, local_s3.endpoint_url),
        command=[*command, "--pidfile", str(home / "trainer.pid")],
    )
    try:
        node.start()
        wait_until(lambda: (node.ckpt / ".progress").exists(), 60, "the trainer training")
        first = node.trainer_pid()
        drill = run_cli("drill", "--deadline", "60", "--json", config=node.config)
        assert drill.returncode == 0, drill.stdout + drill.stderr + node.log_tail()
        saved = json.loads(drill.stdout)["checkpoint"]
        assert saved == (node.ckpt / ".saved").read_text()
        trainer = wait_until(
            lambda: (t := node.get_json("/v1/status")["trainer"])["starts"] == 2 and t,
            30,
            "the trainer started again",
            details=node.log_tail,
        )
        assert trainer["resumed_from"] == saved and trainer["pid"] != first
        assert trainer["restarts"] == 0 and trainer["last_exit"]["code"] == 0
        (started,) = [e for e in node.events("trainer_started") if e["attempt"] == 2]
        assert started["resume_from"] == str(node.ckpt / saved)
        assert len(node.events("trainer_stopped_for_drill")) == 1
        assert node.alive()  # exit 0 after a drill's save is not the run's end
        # The run ledger counts the drill as its own cause, and no interruption.
        run = node.get_json("/v1/status")["goodput"]["run"]
        assert run["seconds"]["drill"] > 0 and run["interruptions"] == 0, run
    finally:
        node.close()


def test_the_restore_only_drill_resumes_the_trainer_refuses_a_run_with_nothing_and_spares_a_dead_store(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    """Issue 45: ``--resume-steps N -- CMD`` starts the trainer from the restored
    checkpoint until it reports N steps; a run with nothing committed is refused with one
    line and nothing written (it used to get a DRILL record); a store that cannot be
    reached fails the drill at restored without a second wait to write its record there."""
    watch = tmp_path / "run1"
    write_bytes(watch / "step-5" / "model.bin", 64 * 1024)
    (watch / "step-5" / "COMPLETE").write_text("5")
    store = ["--dest", s3_dest, "--endpoint-url", local_s3.endpoint_url]
    shipped = run_cli(
        "run", "--once", "--watch", str(watch), "--layout", "marker",
        "--state-dir", str(tmp_path / "state"), *store,
    )  # fmt: skip
    assert shipped.returncode == 0, shipped.stderr
    scratch = ["--scratch", str(tmp_path / "scratch")]

    trainer = [sys.executable, "-m", "tests.support.trainers.resume_steps"]
    resumed = run_cli(
        "drill", "--restore-only", "--run", "run1", *scratch, *store,
        "--resume-steps", "3", "--", *trainer,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    (line,) = [ln for ln in resumed.stdout.splitlines() if ln.strip().startswith("resumed")]
    assert "resumed from step-5 and reported 3 steps (3 asked); it exited 0" in line, line
    (record,) = drill_records(s3_client, s3_prefix, "run1")
    assert [(s["stage"], s["status"]) for s in record["stages"]][-1] == ("resumed", "ok")

    refused = run_cli("drill", "--restore-only", "--run", "nosuchrun", *scratch, *store)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "ckptd: nothing to drill: run 'nosuchrun' has no committed checkpoint"
    ]
    assert (
        s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"{s3_prefix}/nosuchrun/").get("KeyCount")
        == 0
    )

    dead = ["--dest", s3_dest, "--endpoint-url", f"http://127.0.0.1:{free_port()}"]
    unreachable = run_cli("drill", "--restore-only", "--run", "run1", *scratch, *dead)
    assert unreachable.returncode == 1, unreachable.stdout + unreachable.stderr
    assert "result: FAILED at restored" in unreachable.stdout
    assert "recorded: no" in unreachable.stdout
    assert "put_if_absent" not in unreachable.stderr  # no record tried on the dead store
