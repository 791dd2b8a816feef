"""Health sources end to end (docs/health.md): a real ``ckptd run``, a real trainer that
saves a checkpoint on each SIGUSR1 and trains on (tests/support/trainers/save_on_signal.py),
SeaweedFS on loopback, and the kernel log a file fed with the driver's and the kernel's
own line shapes (tests/support/kernel_lines.py cites each).

- a degrading Xid: the trainer is signalled, its checkpoint commits byte-identical, the
  notice file goes and the trainer trains on;
- a fatal Xid: recorded (metrics, condition file), no signal;
- a flood of one kind: one save, the rest reported;
- a DCGM exporter (tests/support/fakes/dcgm_exporter.py): rows remapped, a save; its
  last Xid turning 79, recorded;
- the OOM killer in the trainer's cgroup, and its memory pressure (one event while it
  lasts): a save each;
- a filesystem with less room than the last save: a warning before the next save, and
  no signal;
- NVML through a stand-in (no GPU here): a row remapping pending, reported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.devtools.locals3 import LocalS3
from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from tests.support import kernel_lines as k
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.fakes.dcgm_exporter import FakeDcgmExporter
from tests.support.mounts import fill, tmpfs
from tests.support.trainers.procs import REPO, script_env
from tests.support.writers import local_files

# A save is started at once, or deferred until a save in progress is over.
SAVES = ("save", "defer")
NVML_STANDIN = Path(__file__).resolve().parents[1] / "support" / "fakes" / "nvml"
PSI_CALM = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


class Rig:
    """A trainer, a daemon with ``[health]`` on, the kernel log a file the test appends to."""

    def __init__(
        self,
        tmp_path: Path,
        root: Path,
        dest: str,
        s3: LocalS3,
        mib: int,
        dcgm_url: str = "",
        nvml: bool = False,
    ) -> None:
        self.root, self.dest, self.s3 = root, dest, s3
        self.record, self.pidfile = tmp_path / "signals.txt", tmp_path / "trainer.pid"
        self.kmsg = tmp_path / "kmsg"
        self.kmsg.write_text("")
        self.psi = tmp_path / "psi"
        self.psi.write_text(PSI_CALM)  # the machine's own PSI would make this test its load's
        # The trainer's cgroup v2 directory, its files as cgroup-v2.rst documents them.
        self.cgroup = tmp_path / "cgroup"
        self.cgroup.mkdir()
        self.cgroup_files(oom_kill=0, current=1 << 30)
        self.trainer = subprocess.Popen(
            [
                *(sys.executable, "-m", "tests.support.trainers.save_on_signal"),
                *("--ckpt-dir", str(root), "--pidfile", str(self.pidfile)),
                *("--record", str(self.record), "--mib", str(mib)),
            ],
            env=script_env(tmp_path),
        )
        wait_until(self.pidfile.exists, 30, "the trainer's handler installed")
        self.condition = tmp_path / "condition.json"
        self.daemon = Daemon.configured(
            tmp_path,
            watch=[{"dir": root, "settle_seconds": 0.2}],
            dest=dest,
            endpoint_url=s3.endpoint_url,
            state_dir=tmp_path / "state",
        )
        self.daemon.config.write_text(
            self.daemon.config.read_text()
            + f'[trainer]\npidfile = "{self.pidfile}"\n'
            + "[health]\nenabled = true\npoll_interval_seconds = 0.2\n"
            + f'kmsg = "{self.kmsg}"\npsi = "{self.psi}"\nsave_interval_seconds = 3600\n'
            + f'cgroup = "{self.cgroup}"\ndcgm_url = "{dcgm_url}"\n'
            + f"nvml = {'true' if nvml else 'false'}\n"
            + f'condition_file = "{self.condition}"\n'
        )
        self.seq = 0
        self.nvml_state = tmp_path / "nvml.json"
        if nvml:  # NVML through the stand-in (tests/support/fakes/nvml/pynvml.py)
            self.nvml_gpu(remapped=[0, 0, 0, 0])
            self.daemon.env.update(
                NVML_STANDIN_STATE=str(self.nvml_state),
                PYTHONPATH=os.pathsep.join([str(NVML_STANDIN), str(REPO)]),
            )
        self.exporter: FakeDcgmExporter | None = None

    def cgroup_files(self, *, oom_kill: int, current: int, full_avg10: float = 0.0) -> None:
        """The cgroup's ``memory.events``, ``memory.current``, ``memory.max`` (8 GiB) and
        ``memory.pressure``, each replaced by rename as the kernel's are read whole."""
        files = {
            "memory.events": f"low 0\nhigh 0\nmax 0\noom {oom_kill}\noom_kill {oom_kill}\n"
            "oom_group_kill 0\n",
            "memory.current": f"{current}\n",
            "memory.max": f"{8 << 30}\n",
            "memory.pressure": PSI_CALM.replace("full avg10=0.00", f"full avg10={full_avg10:.2f}"),
        }
        for name, text in files.items():
            tmp = self.cgroup / f".{name}"
            tmp.write_text(text)
            tmp.replace(self.cgroup / name)

    def nvml_gpu(self, **fields: object) -> None:
        """The stand-in NVML's one GPU (its state file replaced by rename)."""
        gpu = {"uuid": "GPU-0", "dbe": 0, "thermal_ns": 0, "power_ns": 0, "temperature": 40}
        tmp = self.nvml_state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": [{**gpu, **fields}]}))
        tmp.replace(self.nvml_state)

    def kernel(self, *texts: str) -> None:
        """Append ``texts`` to the kernel log as ``/dev/kmsg`` records."""
        with self.kmsg.open("a") as out:
            for text in texts:
                self.seq += 1
                out.write(k.kmsg_record(self.seq, text) + "\n")

    def saved_for(self, kind: str) -> None:
        """One save started for ``kind``: at once, or deferred until a save in progress
        (the daemon's own start-up rescan, a commit's tail) was over."""
        started = wait_until(
            lambda: self.daemon.events_named("health_save_started", kind=kind),
            30,
            f"a save started for {kind}",
            details=self.daemon.log_text,
        )
        assert len(started) == 1, started

    def signals(self) -> int:
        return len(self.record.read_text().splitlines()) if self.record.exists() else 0

    def heard(self, kind: str, count: int = 1) -> list[dict[str, object]]:
        return wait_until(
            lambda: (
                (found := self.daemon.events_named("health_event", kind=kind))
                and len(found) >= count
                and found
            ),
            30,
            f"{count} health_event {kind}",
            details=self.daemon.log_text,
        )

    def committed(self, name: str) -> None:
        """``name`` committed, and every byte in the store the trainer's."""
        wait_until(
            lambda: self.daemon.events_named("checkpoint_committed", checkpoint=name),
            60,
            f"{name} committed",
            details=self.daemon.log_text,
        )
        repo = Repository(open_backend(self.dest, endpoint_url=self.s3.endpoint_url))
        manifest = repo.resolve("run", name)
        stored = {
            f.path: repo.storage.get_bytes(object_key("run", manifest.checkpoint, f.path))
            for f in manifest.files
        }
        assert stored == local_files(self.root / name)

    def stop(self) -> None:
        self.trainer.send_signal(signal.SIGKILL)
        self.trainer.wait(timeout=10)


@pytest.fixture
def rig(tmp_path: Path, local_s3: LocalS3, s3_dest: str) -> Iterator[Rig]:
    root = tmp_path / "run"
    root.mkdir()
    exporter = FakeDcgmExporter(gpus=2)
    url = exporter.start_in_thread()
    made = Rig(tmp_path, root, s3_dest, local_s3, mib=1, dcgm_url=f"{url}/metrics")
    made.exporter = exporter
    try:
        yield made
    finally:
        made.stop()
        exporter.stop_thread()


def test_a_degrading_xid_saves_and_the_trainer_trains_on_a_fatal_one_only_records(
    rig: Rig,
) -> None:
    notice_file = rig.root / ".ckptd" / "preemption.json"
    with rig.daemon as daemon:
        wait_until(lambda: daemon.events_named("ckptd_ready"), 30, "the daemon ready")
        rig.kernel(k.XID_63)
        (event,) = rig.heard("xid-63")
        assert (event["severity"], event["action"]) in {("degrading", a) for a in SAVES}
        rig.saved_for("xid-63")
        rig.committed("checkpoint-101")
        wait_until(lambda: daemon.events_named("health_save_done"), 30, "the save's end")
        wait_until(lambda: not notice_file.exists(), 10, "the notice file gone")
        assert rig.trainer.poll() is None, "the trainer must train on after a save"
        assert rig.signals() == 1

        # Fatal: too late to save; recorded, never signalled. The ignored Xid after it is
        # read a poll later: by then a signal for the 79 would have been sent.
        rig.kernel(k.XID_79)
        (fatal,) = rig.heard("xid-79")
        assert (fatal["severity"], fatal["action"]) == ("fatal", "report")
        rig.kernel(k.XID_13)
        (ignored,) = rig.heard("xid-13")
        assert ignored["action"] == "ignore"
        assert rig.signals() == 1

        # A flood of one kind: one save, every other one reported.
        rig.kernel(
            *[
                k.XID_UNKNOWN.replace(
                    "154, GPU recovery action changed from 0x0 to 0x1",
                    "74, NVLink: fatal error detected on link 2",
                )
            ]
            * 20
        )
        flood = [e["action"] for e in rig.heard("xid-74", 20)]
        assert flood[0] in SAVES and flood.count("report") >= 19, flood
        rig.saved_for("xid-74")
        rig.committed("checkpoint-102")
        wait_until(lambda: len(daemon.events_named("health_save_done")) == 2, 30, "2nd save")
        rig.kernel(*[k.XID_63] * 5)  # the first kind again, within its interval
        assert [e["action"] for e in rig.heard("xid-63", 6)][1:] == ["report"] * 5
        assert rig.signals() == 2 and rig.trainer.poll() is None

        # The DCGM exporter: rows remapped on GPU 1 are a new kind (a save); its last Xid
        # turning 79 on GPU 0 is fatal (recorded, no signal).
        assert rig.exporter is not None
        rig.exporter.set_gpu(1, DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS=1)
        (remap,) = rig.heard("row-remap")
        assert (remap["source"], remap["action"]) in {("dcgm", a) for a in SAVES}
        rig.saved_for("row-remap")
        rig.committed("checkpoint-103")
        wait_until(lambda: len(daemon.events_named("health_save_done")) == 3, 30, "3rd save")
        rig.exporter.set_gpu(0, DCGM_FI_DEV_XID_ERRORS=79)
        wait_until(
            lambda: daemon.events_named("health_event", kind="xid-79", source="dcgm"),
            30,
            "the exporter's Xid 79",
        )
        assert rig.signals() == 3 and rig.trainer.poll() is None

        assert len(daemon.events_named("health_save_started")) == 3
        assert daemon.metric("ckptd_health_actions_total", action="report") >= 24
        assert daemon.metric("ckptd_health_source_up", source="dcgm") == 1
        assert (
            daemon.metric(
                "ckptd_health_events_total", source="kmsg", kind="xid-74", severity="degrading"
            )
            == 20
        )
        assert daemon.metric("ckptd_node_healthy") == 0
        ready = daemon.get_json("/readyz")
        assert ready["node_healthy"] is False
        condition = json.loads(rig.condition.read_text())
        assert condition["healthy"] is False and condition["drain"] is True
        assert condition["reason"] == "dcgm:xid-79"  # the last fatal fault
        status = run_cli("status", "--url", f"http://127.0.0.1:{daemon.port}")
        assert "health: UNHEALTHY" in status.stdout, status.stdout + status.stderr


def test_cgroup_oom_and_pressure_save_and_a_too_full_filesystem_warns_before_the_next(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    with tmpfs(tmp_path / "run", 20) as root:
        made = Rig(tmp_path, root, s3_dest, local_s3, mib=4, nvml=True)
        try:
            with made.daemon as daemon:
                wait_until(lambda: daemon.events_named("ckptd_ready"), 30, "the daemon ready")
                # The OOM killer in the trainer's cgroup (memory.events oom_kill grew).
                made.cgroup_files(oom_kill=1, current=1 << 30)
                (event,) = made.heard("oom-kill")
                assert (event["source"], event["action"]) in {("memory", a) for a in SAVES}
                made.saved_for("oom-kill")
                made.committed("checkpoint-101")
                # Memory pressure that lasts is one event, not one per poll; it ends.
                made.cgroup_files(oom_kill=1, current=1 << 30, full_avg10=42.0)
                (pressure,) = made.heard("memory-pressure")
                assert pressure["action"] in SAVES
                made.saved_for("memory-pressure")
                made.committed("checkpoint-102")
                made.cgroup_files(oom_kill=1, current=1 << 30)
                wait_until(
                    lambda: daemon.events_named("health_condition_ended", kind="memory-pressure"),
                    30,
                    "the pressure's end",
                )
                assert len(daemon.events_named("health_event", kind="memory-pressure")) == 1
                assert not daemon.events_named("health_event", kind="disk-space")
                fill(root)  # less room than the 4 MiB just saved
                (warning,) = made.heard("disk-space")
                assert (warning["severity"], warning["action"]) == ("warning", "report")
                assert made.signals() == 2  # warned, not saved into a full disk
                assert daemon.metric("ckptd_health_fs_free_bytes", run="run") < 4 << 20
                # NVML (the stand-in): a row remapping pending is a warning, reported.
                assert daemon.metric("ckptd_health_source_up", source="nvml") == 1
                made.nvml_gpu(remapped=[0, 0, 1, 0])
                (pending,) = made.heard("row-remap-pending")
                assert (pending["source"], pending["action"]) == ("nvml", "report")
                assert made.signals() == 2
        finally:
            made.stop()
