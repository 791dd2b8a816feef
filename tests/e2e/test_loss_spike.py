"""The training's own health end to end (docs/health.md, "The training's own health"): a
real PyTorch trainer (tests/support/trainers/loss_spike.py) reports its loss with its
steps beside ``ckptd run`` on SeaweedFS; its loss spikes, then turns NaN. The newest
checkpoint committed before the spike survives ``keep_last = 2`` retention that removes
its neighbours (its objects read back, byte for byte), the NaN protects one more, and a
rollback to the protected checkpoint (``ckptd restore --checkpoint``, then the trainer's
``report_resumed``) trains on and commits on a new trajectory that LATEST follows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from tests.support.daemon import Daemon, run_cli, wait_until, write_config
from tests.support.harness import RUN_ID
from tests.support.writers import local_files

TRAINER = "tests.support.trainers.loss_spike"
HEALTH = (
    "[retention]\nkeep_last = 2\n"
    "[health]\npoll_interval_seconds = 0.2\nloss_window = 30\nloss_min_reports = 20\n"
)


def start_trainer(ckpt: Path, out: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", TRAINER, "--dir", str(ckpt), "--out", str(out), *args],
        stdout=subprocess.DEVNULL,
        stderr=open(out.with_suffix(".log"), "wb"),
    )


def open_gate(daemon: Daemon, step: int, file: Path) -> None:
    """Touch ``file`` once ``step-<step>`` committed (a trainer's ``--gate`` waits on it)."""
    wait_until(
        lambda: daemon.events_named("checkpoint_committed", checkpoint=f"step-{step}"),
        120,
        f"step-{step} committed",
    )
    file.touch()


def finished(proc: subprocess.Popen[bytes], out: Path, timeout: float) -> dict[str, Any]:
    proc.wait(timeout)
    assert proc.returncode == 0, out.with_suffix(".log").read_text()
    return dict(json.loads(out.read_text()))


def test_a_loss_spike_keeps_its_rollback_target_through_retention_and_the_rollback_works(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    ckpt = tmp_path / "run"
    ckpt.mkdir()
    watch = [{"dir": ckpt, "run_id": RUN_ID, "layout": "marker", "settle_seconds": 0.2}]
    where = {"dest": s3_dest, "endpoint_url": local_s3.endpoint_url}
    daemon = Daemon.configured(tmp_path, watch=watch, state_dir=tmp_path / "state", **where)
    daemon.config.write_text(daemon.config.read_text() + HEALTH)
    repo = Repository(open_backend(s3_dest, endpoint_url=local_s3.endpoint_url))
    go, first_out = tmp_path / "go", tmp_path / "first.json"
    spiked = ["--steps", "140", "--save-every", "20", "--spike-at", "70", "--nan-at", "110"]
    # The spike and the NaN each wait until the saves before them committed: what they
    # protect is then the newest below them, however loaded the machine.
    gates = {60: tmp_path / "60-committed", 100: tmp_path / "100-committed"}
    spiked += [f"--gate={step + 10}:{file}" for step, file in gates.items()]
    trainer = None
    try:
        daemon.start()
        trainer = start_trainer(ckpt, first_out, *spiked, "--go", str(go))
        for step, file in gates.items():
            threading.Thread(target=open_gate, args=(daemon, step, file), daemon=True).start()
        # The trainer waits at its spike (step 70) until the daemon has acted.
        wait_until(
            lambda: repo.read_protections(RUN_ID, now=time.time()),
            120,
            "the spike's rollback target protected",
            details=daemon.log_text,
        )
        assert repo.read_protections(RUN_ID, now=time.time()) == {"step-60": "loss-spike"}
        before = local_files(ckpt / "step-60")
        go.touch()
        first = finished(trainer, first_out, 120)
        assert first["saved"] == [20, 40, 60, 80, 100, 120, 140] and first["last_loss"] == "nan"
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="step-140"),
            120,
            "the last checkpoint committed",
            details=daemon.log_text,
        )

        # keep_last = 2 keeps step-120 and step-140; the rest goes but what is protected.
        def settled() -> Any:
            protected = repo.read_protections(RUN_ID, now=time.time())
            names = {c.manifest.checkpoint for c in repo.list_committed(RUN_ID)}
            return len(protected) == 2 and names == {*protected, "step-120", "step-140"}

        wait_until(settled, 60, "retention past the protected checkpoints", details=daemon.log_text)
        protected = repo.read_protections(RUN_ID, now=time.time())
        assert protected.pop("step-60") == "loss-spike"
        # The NaN (step 110) kept the newest checkpoint below it committed by then.
        assert list(protected.values()) == ["non-finite"], protected
        assert next(iter(protected)) in ("step-80", "step-100")
        manifest = repo.resolve(RUN_ID, "step-60")
        stored = {
            f.path: repo.storage.get_bytes(object_key(RUN_ID, "step-60", f.path))
            for f in manifest.files
        }
        assert set(stored) == {"state.pt", "COMPLETE"} and stored == before
        # Saved after the NaN: suspect in the manifest; before it: not.
        why = "saved after a non-finite loss at step 110"
        assert [repo.resolve(RUN_ID, f"step-{s}").suspect for s in (120, 140)] == [why, why]
        assert repo.resolve(RUN_ID, next(iter(protected))).suspect is None
        assert manifest.suspect is None
        metrics = daemon_metrics(daemon)
        assert 'ckptd_loss_spikes_total{kind="spike",run="run"} 1.0' in metrics
        assert 'ckptd_loss_spikes_total{kind="non-finite",run="run"} 1.0' in metrics
        assert 'ckptd_protected_checkpoints{run="run"} 2.0' in metrics
        rollback(daemon, repo, ckpt, tmp_path, before, where)
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        daemon.stop(60)


def daemon_metrics(daemon: Daemon) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def rollback(
    daemon: Daemon,
    repo: Repository,
    ckpt: Path,
    tmp_path: Path,
    before: dict[str, bytes],
    where: dict[str, str],
) -> None:
    """The rollback a person decides on: the protected checkpoint restored from the store
    (the local copy gone, as on a fresh node), the trainer resumed from it."""
    shutil.rmtree(ckpt / "step-60")
    config = write_config(
        tmp_path / "restore.toml",
        watch=[{"dir": ckpt, "run_id": RUN_ID}],
        state_dir=tmp_path / "restore-state",
        port=free_port(),
        **where,
    )
    listed = run_cli("list", "--run", RUN_ID, config=config)
    assert listed.returncode == 0, listed.stderr
    # RUN CHECKPOINT STEP SIZE COMMITTED (UTC, ends in Z) STATE
    rows = listed.stdout.splitlines()[1:]
    states = {line.split()[1]: line.rsplit("Z", 1)[1].split() for line in rows}
    assert states["step-140"] == ["latest", "suspect"] and states["step-120"] == ["suspect"]
    assert states["step-60"] == [], listed.stdout
    done = run_cli(
        "restore", "--run", RUN_ID, "--checkpoint", "step-60", "--to", str(ckpt), config=config
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert local_files(ckpt / "step-60") == before
    out = tmp_path / "second.json"
    trainer = start_trainer(ckpt, out, "--steps", "80", "--save-every", "20", "--resume", "step-60")
    second = finished(trainer, out, 120)
    assert second["resumed_at"] == 60 and second["finite"] and second["saved"] == [80]
    assert second["last_loss"] != "nan"

    def forked() -> Any:
        latest = repo.read_latest(RUN_ID)
        if latest is None or latest.step != 80:
            return None
        m = repo.resolve(RUN_ID, latest.checkpoint)
        return m if m.lineage.forked_from is not None else None

    manifest = wait_until(forked, 120, "the rollback's step-80 as LATEST", details=daemon.log_text)
    assert manifest.lineage.forked_from.checkpoint == "step-60"
    assert manifest.lineage.id != "" and manifest.suspect is None
    stored = repo.storage.get_bytes(object_key(RUN_ID, manifest.checkpoint, "state.pt"))
    assert stored == (ckpt / "step-80" / "state.pt").read_bytes()
