"""Preemption end to end: a fake cloud metadata server, the daemon as a real process,
and a real trainer process that saves when signalled."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, committed_manifest, wait_until
from tests.support.fakes.aws_imds import FakeAwsImds
from tests.support.fakes.azure_metadata import FakeAzureMetadata
from tests.support.fakes.gcp_metadata import FakeGcpMetadata
from tests.support.faultproxy import FaultProxy
from tests.support.writers import write_bytes

MiB = 1024 * 1024


class Trainer:
    """The toy trainer as a subprocess, ended by PID if still running."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pidfile = root.parent / "trainer.pid"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.trainers.toy_preemptible",
                "--dir",
                str(root),
                "--pidfile",
                str(self.pidfile),
            ],
            stdin=subprocess.DEVNULL,
        )
        wait_until(lambda: (root / ".progress").exists(), 30, "trainer started")

    def saved(self) -> str | None:
        path = self.root / ".saved"
        return path.read_text() if path.exists() else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def trainer_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    root.mkdir()
    return root


@pytest.fixture
def trainer(trainer_root: Path) -> Iterator[Trainer]:
    t = Trainer(trainer_root)
    try:
        yield t
    finally:
        t.close()


def _config(
    tmp_path: Path, local_s3: LocalS3, dest: str, provider: str, endpoint: str, pidfile: Path
) -> Daemon:
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": tmp_path / "run", "settle_seconds": 0.2}],
        dest=dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=tmp_path / "state",
    )
    text = daemon.config.read_text().replace('[preemption]\nprovider = "none"', "")
    text += f'[preemption]\nprovider = "{provider}"\nendpoint = "{endpoint}"\npoll_interval_seconds = 0.2\n'
    text += f'[trainer]\npidfile = "{pidfile}"\n'
    daemon.config.write_text(text)
    return daemon


def _trigger(cloud: str, fake: Any) -> str:
    if cloud == "aws":
        return str(fake.trigger_spot("terminate"))
    if cloud == "gcp":
        fake.preempt()
        return "preempted"
    return str(fake.add_event("Preempt"))


FAKES = {"aws": FakeAwsImds, "gcp": FakeGcpMetadata, "azure": FakeAzureMetadata}


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_notice_signals_the_trainer_and_commits_its_emergency_checkpoint(
    cloud: str,
    tmp_path: Path,
    local_s3: LocalS3,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
    trainer: Trainer,
) -> None:
    fake = FAKES[cloud]()
    url = fake.start_in_thread()
    try:
        with _config(tmp_path, local_s3, s3_dest, cloud, url, trainer.pidfile) as daemon:
            assert daemon.get_json("/v1/preemption") == {"notice": False}
            event_id = _trigger(cloud, fake)
            # The trainer saves only when it learns of the notice: by the daemon's signal.
            name = wait_until(trainer.saved, 20, "the trainer's emergency save")
            assert trainer.proc.wait(timeout=20) == 0
            wait_until(
                lambda: committed_manifest(s3_client, s3_prefix, "run", name),
                30,
                "emergency commit",
            )
            done = wait_until(
                lambda: daemon.events_named("emergency_checkpoint_committed"), 10, "timings"
            )
            notice = daemon.get_json("/v1/preemption")
            assert notice["notice"] is True and notice["source"] == cloud
            assert (
                json.loads((trainer.root / ".ckptd" / "preemption.json").read_text())["source"]
                == cloud
            )
            signalled = daemon.events_named("trainer_signalled")
            assert signalled and signalled[0]["pids"] == [trainer.proc.pid]
            timings = done[0]
            assert timings["checkpoint"] == name
            assert (
                0
                <= timings["signalled_after_s"]
                <= timings["complete_after_s"]
                <= timings["committed_after_s"]
            )
            assert timings["committed_before_deadline"] is True
            assert daemon.metric("ckptd_preemption_notice") == 1
            if cloud == "azure":
                # Acknowledged only after the emergency checkpoint was committed.
                wait_until(lambda: event_id in fake.acks, 10, "StartRequests ack")
    finally:
        fake.stop_thread()


def test_a_notice_whose_time_moves_every_poll_is_one_notice_one_signal_one_emergency_commit(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
    trainer: Trainer,
) -> None:
    """A metadata endpoint that restates the spot time on every read once made a new
    notice every second (the id held the time), and each new one moved the emergency's
    start past the checkpoint saved for the first: never an emergency commit. The action
    is the notice; a moved time moves its deadline."""
    imds = FakeAwsImds()
    url = imds.start_in_thread()
    try:
        with _config(tmp_path, local_s3, s3_dest, "aws", url, trainer.pidfile) as daemon:
            imds.trigger_spot_moving("terminate", ahead=120)
            name = wait_until(trainer.saved, 20, "the trainer's emergency save")
            assert trainer.proc.wait(timeout=20) == 0
            (done,) = wait_until(
                lambda: daemon.events_named("emergency_checkpoint_committed"),
                30,
                "the emergency commit",
            )
            assert done["checkpoint"] == name
            (received,) = daemon.events_named("notice_received")
            assert received["id"] == "spot:terminate:1"
            # Still one notice seconds later, the time having moved on every read; its
            # deadline is the latest one stated.
            wait_until(
                lambda: daemon.get_json("/v1/preemption")["deadline"] > received["deadline"],
                10,
                "the deadline to move",
            )
            assert len(daemon.events_named("notice_received")) == 1
            assert len(daemon.events_named("trainer_signalled")) == 1
        key = f"{s3_prefix}/run/{name}/model.safetensors"
        stored = s3_client.get_object(Bucket="ckpt", Key=key)["Body"].read()
        assert stored == (trainer.root / name / "model.safetensors").read_bytes()
    finally:
        imds.stop_thread()


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
@pytest.mark.parametrize("mode", ["garbage", "500", "hang"])
def test_bad_metadata_never_signals_the_trainer(
    cloud: str, mode: str, tmp_path: Path, local_s3: LocalS3, s3_dest: str, trainer: Trainer
) -> None:
    fake = FAKES[cloud]()
    url = fake.start_in_thread()
    fake.set_mode(mode)
    try:
        with _config(tmp_path, local_s3, s3_dest, cloud, url, trainer.pidfile) as daemon:
            # Several polls of garbage later (a hanging service holds one request open):
            # no notice, no signal, everything alive.
            wanted = 1 if mode == "hang" else 6
            wait_until(lambda: len(fake.requests) >= wanted, 20, "the daemon polling the fake")
            assert daemon.get_json("/v1/preemption") == {"notice": False}
            assert trainer.proc.poll() is None and trainer.saved() is None
            assert not daemon.events_named("trainer_signalled")
            assert daemon.alive()
            if cloud == "azure" and mode == "hang":
                return  # Azure's first call may take minutes by design: the source waits it out
            # And when the service recovers and a real notice comes, it is acted on.
            fake.set_mode("ok")
            _trigger(cloud, fake)
            wait_until(trainer.saved, 30, "the trainer's emergency save after recovery")
    finally:
        fake.stop_thread()


def test_drill_reports_timings_and_commits_in_time(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
    trainer: Trainer,
) -> None:
    with _config(tmp_path, local_s3, s3_dest, "none", "", trainer.pidfile) as daemon:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "ckptd",
                "drill",
                "--deadline",
                "60",
                "--config",
                str(daemon.config),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        for row in ("noticed", "trainer signalled", "checkpoint complete", "committed"):
            assert row in result.stdout
        name = trainer.saved()
        assert name and name in result.stdout
        assert committed_manifest(s3_client, s3_prefix, "run", name) is not None
        # A drill ends: the notice is cleared so a restarted trainer is not stopped again.
        assert daemon.get_json("/v1/preemption") == {"notice": False}
        assert not (trainer.root / ".ckptd" / "preemption.json").exists()


def test_sigterm_with_an_upload_in_flight_finishes_it_before_exit(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": root, "settle_seconds": 0}],
        dest=s3_dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=tmp_path / "state",
        part_size_mib=5,
        concurrency=2,
        max_upload_mib_per_s=10,
    )
    daemon.extra_args = ["--shutdown-timeout", "30"]
    with daemon:
        ckpt = root / "checkpoint-9"
        write_bytes(ckpt / "model.safetensors", 30 * MiB)
        (ckpt / "trainer_state.json").write_text("{}")
        wait_until(
            lambda: daemon.metric("ckptd_upload_bytes_total", run="run") > 0, 30, "upload started"
        )
        assert committed_manifest(s3_client, s3_prefix, "run", "checkpoint-9") is None
        started = time.monotonic()
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=40) == 0
        took = time.monotonic() - started
    assert committed_manifest(s3_client, s3_prefix, "run", "checkpoint-9") is not None, (
        "exited before the flush"
    )
    assert took < 30
    assert daemon.events_named("flushed_on_sigterm")


def test_sigterm_waits_for_a_store_that_is_unreachable_and_commits_when_it_returns(
    tmp_path: Path, fault_proxy: FaultProxy, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    """A store that is down but not refusing (connections reset) may come back within
    the grace period: the SIGTERM flush keeps at it, and the checkpoint commits once the
    store answers. (Only a refusal, such as denied credentials, ends the flush at once.)"""
    root = tmp_path / "run"
    root.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": root, "settle_seconds": 0}],
        dest=s3_dest,
        endpoint_url=fault_proxy.url,
        state_dir=tmp_path / "state",
        max_attempts=2,
    )
    daemon.extra_args = ["--shutdown-timeout", "40"]
    with daemon:
        fault_proxy.set_faults(rate=1.0, kinds=("reset",))
        ckpt = root / "checkpoint-9"
        write_bytes(ckpt / "model.safetensors", 1 * MiB)
        (ckpt / "trainer_state.json").write_text("{}")
        # The checkpoint fails, so the store is asked again soon and found down.
        wait_until(lambda: daemon.metric("ckptd_destination_up") == 0, 30, "destination down")
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: daemon.events_named("sigterm_received"), 10, "SIGTERM taken")
        fault_proxy.clear_faults()
        assert daemon.proc.wait(timeout=60) == 0
    assert committed_manifest(s3_client, s3_prefix, "run", "checkpoint-9") is not None
    assert daemon.events_named("flushed_on_sigterm")
    assert not daemon.events_named("sigterm_flush_impossible")


def test_trainer_is_found_by_cmdline_match_and_never_ckptd_itself(tmp_path: Path) -> None:
    from ckptd.notices.responder import find_trainer_pids

    marker = f"ckptd-test-trainer-{tmp_path.name}"
    script = "import sys, time; time.sleep(60)"
    ranks = [subprocess.Popen([sys.executable, "-c", script, marker]) for _ in range(2)]
    lookalike = subprocess.Popen([sys.executable, "-m", "ckptd.cli.main", "--version", marker])
    try:
        pids = wait_until(
            lambda: len(find_trainer_pids("", marker)) >= 2 and find_trainer_pids("", marker),
            10,
            "ranks",
        )
        assert sorted(pids) == sorted(p.pid for p in ranks)  # every rank; not the ckptd process
        pidfile = tmp_path / "trainer.pid"
        pidfile.write_text(f"{ranks[0].pid}\n")
        assert find_trainer_pids(str(pidfile), "") == [ranks[0].pid]
        assert find_trainer_pids(str(tmp_path / "missing.pid"), "") == []
    finally:
        for p in [*ranks, lookalike]:
            p.kill()
            p.wait()
