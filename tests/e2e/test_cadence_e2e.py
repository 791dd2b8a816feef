"""Checkpoint cadence end to end: the daemon as a real process, a real HF Trainer under
``CkptdCallback(follow_advice=True)``, spot notices from the AWS metadata fake, the
history in a real S3 (SeaweedFS) and inherited by a second daemon."""

from __future__ import annotations

import itertools
import json
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptd.cadence.model import Bounds, advised_interval
from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, wait_until
from tests.support.fakes.aws_imds import FakeAwsImds
from tests.support.trainers.procs import Script, script_env

pytest.importorskip("transformers")

# Seconds-scale cadence: a prior MTBF of 6 minutes, saves of a few milliseconds.
CADENCE = (
    "[cadence]\nprior_mtbf_hours = 0.1\nmin_interval_seconds = 0.5\n"
    "max_interval_seconds = 60\nmerge_seconds = 0.3\n"
)
# Notices, each more than the advised interval after the one before (a notice sooner
# than that is the next blow of a burst, which ckptd.cadence.model does not count as costly).
NOTICES = 3
# A decision is taken at a step end: up to a step (and a busy 2-core machine) late.
SLACK_SECONDS = 0.75


def _daemon(
    tmp_path: Path, local_s3: LocalS3, dest: str, watch: Path, aws: str, name: str
) -> Daemon:
    daemon = Daemon.configured(
        tmp_path,
        name=name,
        watch=[{"dir": watch, "run_id": "run", "layout": "hf", "settle_seconds": 0.2}],
        dest=dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=tmp_path / f"state-{name}",
    )
    text = daemon.config.read_text().replace('[preemption]\nprovider = "none"', "")
    text += f'[preemption]\nprovider = "aws"\nendpoint = "{aws}"\npoll_interval_seconds = 0.1\n'
    daemon.config.write_text(text + CADENCE)
    return daemon


def _saves(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class AdviceSeen:
    """Every interval the daemon advised while the test ran (polled /v1/advice)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.values: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            try:
                run = self.daemon.get_json("/v1/advice")["runs"]["run"]
                self.values.append(float(run["interval_seconds"]))
            except (OSError, KeyError, ValueError):
                pass
            self.stop.wait(0.05)


def _followed(saves: list[dict[str, Any]], lo: float, hi: float) -> list[dict[str, Any]]:
    """The advised saves whose interval lay in [lo, hi], each checked against the gap
    since the previous save ended: never sooner than the interval, at most SLACK later."""
    checked = []
    for prev, save in itertools.pairwise(saves):
        if not save["advised"] or save["interval"] is None:
            continue
        gap = save["began"] - prev["ended"]
        assert gap >= save["interval"] - 0.05, (prev, save)
        assert gap <= save["interval"] + SLACK_SECONDS, (prev, save)
        assert save["began"] >= prev["ended"]  # never a save while the last is written
        if lo <= save["interval"] <= hi:
            checked.append(save)
    return checked


def test_trainer_saves_on_the_advised_interval_and_notices_shorten_it(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    fake = FakeAwsImds()
    aws = fake.start_in_thread()
    saves_log = tmp_path / "saves.jsonl"
    script: Script | None = None
    try:
        with _daemon(tmp_path, local_s3, s3_dest, out, aws, "node-a") as daemon:
            seen = AdviceSeen(daemon)
            first = daemon.get_json("/v1/advice")["runs"]["run"]
            assert first["basis"] == {"save": "none", "mtbf": "prior"}
            assert first["mtbf_seconds"] == pytest.approx(360.0, rel=0.05)
            script = Script(
                tmp_path,
                "hf_cadence",
                "--output-dir", str(out),
                "--saves", str(saves_log),
                "--stop", str(tmp_path / "stop"),
                "--notice-dir", str(tmp_path / "elsewhere"),
                env=script_env(tmp_path),
            )  # fmt: skip
            # The save cost comes from the trainer's own report of its save time.
            measured = wait_until(
                lambda: (
                    (a := daemon.get_json("/v1/advice")["runs"]["run"])["basis"]["save"]
                    == "trainer"
                    and a["saves_measured"] >= 4
                    and a
                ),
                90,
                "the trainer's save times in the advice",
                0.1,
                script.log_tail,
            )
            assert 0 < measured["save_seconds"] < 5
            quiet = measured["interval_seconds"]
            assert quiet >= 1.0  # sqrt(2 C M) - C with M >= 360 s, C >= ~5 ms
            n_before = len(_saves(saves_log))
            before = wait_until(
                lambda: (
                    len(got := _followed(_saves(saves_log)[n_before:], 0.6 * quiet, 2 * quiet)) >= 2
                    and got
                ),
                60,
                "two saves on the advised interval",
                0.1,
                script.log_tail,
            )
            assert len(before) >= 2

            # Spot notices, each a new one (a new time), each seen before the next.
            start = datetime.now(UTC)
            for k in range(NOTICES):
                fake.trigger_spot("terminate", at=start + timedelta(minutes=2, seconds=k))
                wait_until(
                    lambda k=k: daemon.get_json("/v1/advice")["runs"]["run"]["interruptions"] > k,
                    10,
                    f"notice {k + 1} recorded",
                )
                fake.clear_spot()
                noticed = time.monotonic()
                wait_until(
                    lambda noticed=noticed: (
                        time.monotonic() - noticed
                        > 1.2 * daemon.get_json("/v1/advice")["runs"]["run"]["interval_seconds"]
                    ),
                    30,
                    "an interval since the notice",
                    0.1,
                )
            after = daemon.get_json("/v1/advice")["runs"]["run"]
            assert after["basis"]["mtbf"] == "measured"
            assert after["interruptions"] == after["costly_interruptions"] == NOTICES
            # Notices an interval or more apart are no burst: no early save after a restart.
            assert after["quick_repeats"] == 0
            assert after["restart_interval_seconds"] == after["interval_seconds"]
            published = json.loads((out / ".ckptd" / "advice.json").read_text())
            assert published["restart_interval_seconds"] == published["interval_seconds"] > 0
            busy = after["interval_seconds"]
            # The save time is measured afresh all along and wanders on a busy machine;
            # what the notices change is the MTBF, and the interval with it: shorter than
            # the quiet MTBF would give at today's save time.
            assert after["mtbf_seconds"] < 0.25 * measured["mtbf_seconds"], (measured, after)
            at_quiet_rate = advised_interval(
                after["save_seconds"], measured["mtbf_seconds"], 0.0, Bounds(0.5, 60.0)
            )
            assert busy < 0.6 * at_quiet_rate, (at_quiet_rate, after)
            assert daemon.metric(
                "ckptd_advised_checkpoint_interval_seconds", run="run"
            ) == pytest.approx(busy, rel=0.25)
            # The trainer follows the shorter interval (it re-reads the advice file).
            n_before = len(_saves(saves_log))
            wait_until(
                lambda: len(_followed(_saves(saves_log)[n_before - 1 :], 0, 1.5 * busy)) >= 2,
                60,
                "two saves on the shorter interval",
                0.1,
                script.log_tail,
            )
            cost = after["expected_cost"]
            assert cost["advised"]["total_fraction"] > 0
            # Every interval the trainer followed was one the daemon advised.
            for save in _saves(saves_log):
                if save["advised"]:
                    assert min(seen.values) - 0.01 <= save["interval"] <= max(seen.values) + 0.01
            (tmp_path / "stop").write_text("")
            assert script.wait_exit(60) == 0, script.log_tail()
            seen.stop.set()
            # SIGTERM: a clean stop writes what is left to the store; being a notice
            # (Kubernetes' eviction), it is one more interruption.
            assert daemon.stop() == 0

        # The history is in the store, under the run, and never taken for a checkpoint.
        body = s3_client.get_object(Bucket="ckpt", Key=f"{s3_prefix}/run/CADENCE")["Body"].read()
        stored = json.loads(body)
        assert [i["kind"] for i in stored["interruptions"]] == ["notice"] * (NOTICES + 1)
        assert stored["interruptions"][-1]["source"] == "sigterm"
        assert {s["basis"] for s in stored["saves"]} == {"trainer"}
        # A fresh node inherits it: its advice starts from the measured figures.
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        with _daemon(tmp_path, local_s3, s3_dest, fresh, aws, "node-b") as other:
            inherited = wait_until(
                lambda: (
                    (a := other.get_json("/v1/advice")["runs"]["run"])["history"] == "read" and a
                ),
                30,
                "the history read",
            )
            assert inherited["interruptions"] == NOTICES + 1
            assert inherited["basis"] == {"save": "trainer", "mtbf": "measured"}
            assert inherited["mtbf_seconds"] < 0.25 * measured["mtbf_seconds"]
    finally:
        if script is not None:
            script.kill()
        fake.stop_thread()
