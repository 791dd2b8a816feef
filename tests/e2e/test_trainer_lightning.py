"""CkptdLightningCallback in a real PyTorch Lightning run (tiny model on CPU, child process)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ckptd.core import saves
from tests.support.daemon import wait_until
from tests.support.notice_file import HEALTH_SAVE, replace_notice
from tests.support.trainers.procs import Script, script_env

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

MAX_STEPS = 100_000

# What SLURM sets for a one-task job; with them Lightning would take SIGUSR1 for requeue.
SLURM_ENV = {
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
}


def run_until_signalled(tmp_path: Path, *args: str, env: dict[str, str]) -> Script:
    script = Script(tmp_path, "lightning_train", *args, env=env)
    script.interrupt_at_step(
        3, lambda: script.signal(signal.SIGUSR1), step_timeout=60, exit_timeout=30
    )
    return script


def assert_preemption_checkpoint(script: Script, directory: Path) -> int:
    result = script.result_json()
    step = result["global_step"]
    assert 3 <= step < MAX_STEPS
    path = directory / f"preempt-step={step}.ckpt"
    assert result["saved_path"] == str(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == step
    assert "state_dict" in checkpoint and "optimizer_states" in checkpoint
    # No scratch left beside it (.ckptd/ is the helpers' own: the save report below).
    leftovers = [p for p in directory.iterdir() if p.name.startswith(".") or "tmp" in p.name]
    assert [p.name for p in leftovers] == [".ckptd"]
    # Reported to the daemon, which then takes it as complete without a quiet window.
    reports = saves.read_reports(directory)
    assert saves.saved_at_ns(reports, path.name, step, path.stat().st_mtime_ns) is not None
    return int(step)


def test_sigusr1_saves_step_checkpoint_in_default_root_dir_and_exits_0(tmp_path: Path) -> None:
    root = tmp_path / "root"
    script = run_until_signalled(tmp_path, "--root-dir", str(root), env=script_env(tmp_path))
    assert_preemption_checkpoint(script, root)


def test_under_slurm_ckptd_handler_wins_over_lightning_requeue(tmp_path: Path) -> None:
    root, checkpoints = tmp_path / "root", tmp_path / "checkpoints"
    script = run_until_signalled(
        tmp_path,
        "--root-dir",
        str(root),
        "--checkpoint-dir",
        str(checkpoints),
        "--slurm",
        env=script_env(tmp_path, **SLURM_ENV),
    )
    log = script.log_tail(20_000)
    assert "SLURM auto-requeueing enabled" in log  # Lightning did try to take SIGUSR1 ...
    assert "auto-requeue on it is off" in log  # ... and the user is told why it did not

    result = script.result_json()
    assert result["handler_during_fit"] == "ckptd"
    assert result["handler_after_fit"] == "ckptd"  # Lightning's teardown put ours back
    step = assert_preemption_checkpoint(script, checkpoints)
    # Lightning's requeue handler would have saved an hpc checkpoint and run scontrol.
    assert not list(tmp_path.rglob("hpc_ckpt_*.ckpt"))
    assert step < MAX_STEPS


def test_a_health_save_is_saved_and_training_goes_on_until_a_notice_that_stops_it(
    tmp_path: Path,
) -> None:
    """A notice that asks for a save only (a health ``save``, docs/health.md): the
    checkpoint is saved and reported, the fit goes on; the next notice (a signal with no
    notice of its own: a stop) saves again and ends it."""
    root = tmp_path / "root"
    script = Script(tmp_path, "lightning_train", "--root-dir", str(root), env=script_env(tmp_path))
    try:
        script.wait_for_step(3, timeout=60)
        replace_notice(root, HEALTH_SAVE)  # a health save: save, then train on
        (first,) = wait_until(lambda: list(root.glob("preempt-step=*.ckpt")), 60, "the save")
        saved_at = int(first.name.removeprefix("preempt-step=").removesuffix(".ckpt"))
        script.wait_for_step(saved_at + 5, timeout=60)  # trains on past it
        script.signal(signal.SIGUSR1)
        assert script.wait_exit(timeout=60) == 0, script.log_tail()
    finally:
        script.kill()
    result = script.result_json()
    assert result["save_only_saves"] == [str(first)]
    step = assert_preemption_checkpoint(script, root)
    assert step > saved_at + 5
    for path, at in ((first, saved_at), (root / f"preempt-step={step}.ckpt", step)):
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        assert checkpoint["global_step"] == at
