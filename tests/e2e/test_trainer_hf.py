"""CkptdCallback in a real Hugging Face Trainer run (tiny GPT-2 on CPU, in a child process)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from ckptd.core import saves
from tests.support.daemon import wait_until
from tests.support.notice_file import HEALTH_SAVE, replace_notice
from tests.support.trainers.procs import Script, script_env

pytest.importorskip("transformers")

MAX_STEPS = 100_000


def test_sigusr1_makes_the_trainer_save_checkpoint_at_current_step_and_exit_0(
    tmp_path: Path,
) -> None:
    output_dir = tmp_path / "out"
    script = Script(
        tmp_path,
        "hf_train",
        "--output-dir",
        str(output_dir),
        "--max-steps",
        str(MAX_STEPS),
        "--save-steps",
        str(MAX_STEPS),  # no regular save: any checkpoint is the preemption one
        env=script_env(tmp_path),
    )
    script.interrupt_at_step(
        3, lambda: script.signal(signal.SIGUSR1), step_timeout=60, exit_timeout=30
    )

    result = script.result_json()
    step = result["global_step"]
    assert 3 <= step < MAX_STEPS
    assert result["fired_at_step"] == step
    checkpoints = sorted(p.name for p in output_dir.glob("checkpoint-*"))
    assert checkpoints == [f"checkpoint-{step}"]
    state = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    assert state["global_step"] == step
    assert not (output_dir / f"checkpoint-{step}" / "checkpoint-is-incomplete.txt").exists()
    # The callback reported the save after it returned (ckptd.core.saves): complete at once.
    oldest = min(p.stat().st_mtime_ns for p in (output_dir / f"checkpoint-{step}").iterdir())
    reports = saves.read_reports(output_dir)
    assert saves.saved_at_ns(reports, f"checkpoint-{step}", step, oldest) is not None


def test_notice_file_in_output_dir_stops_the_trainer(tmp_path: Path) -> None:
    # No watch dir configured: the callback watches args.output_dir.
    output_dir = tmp_path / "out"
    script = Script(tmp_path, "hf_train", "--output-dir", str(output_dir), env=script_env(tmp_path))
    notice = output_dir / ".ckptd" / "preemption.json"

    def write_notice() -> None:
        notice.parent.mkdir(parents=True, exist_ok=True)
        notice.write_text(json.dumps({"source": "gcp", "kind": "preempted", "deadline": None}))

    script.interrupt_at_step(3, write_notice, step_timeout=60, exit_timeout=30)

    result = script.result_json()
    step = result["global_step"]
    assert step < MAX_STEPS
    assert (output_dir / f"checkpoint-{step}" / "trainer_state.json").exists()
    assert result["notice"]["source"] == "gcp"


def test_a_health_save_is_saved_and_training_goes_on_until_a_notice_that_stops_it(
    tmp_path: Path,
) -> None:
    """A notice that asks for a save only (a health ``save``, docs/health.md): the
    Trainer saves that step and trains on; the next notice (a signal with no notice of
    its own: a stop) saves again and ends it."""
    output_dir = tmp_path / "out"
    script = Script(
        tmp_path,
        "hf_train",
        *("--output-dir", str(output_dir), "--max-steps", str(MAX_STEPS)),
        *("--save-steps", str(MAX_STEPS)),  # no regular save: each checkpoint is a notice's
        env=script_env(tmp_path),
    )
    state = "trainer_state.json"  # written last: the checkpoint is whole
    try:
        script.wait_for_step(3, timeout=60)
        replace_notice(output_dir, HEALTH_SAVE)  # a health save: save, then train on
        (first,) = wait_until(lambda: list(output_dir.glob(f"checkpoint-*/{state}")), 60, "save")
        saved_at = int(first.parent.name.removeprefix("checkpoint-"))
        script.wait_for_step(saved_at + 5, timeout=60)  # trains on past it
        script.signal(signal.SIGUSR1)
        assert script.wait_exit(timeout=60) == 0, script.log_tail()
    finally:
        script.kill()
    result = script.result_json()
    step = result["global_step"]
    assert result["save_only_steps"] == [saved_at]
    assert result["fired_at_step"] == step and step > saved_at + 5
    checkpoints = sorted(p.name for p in output_dir.glob("checkpoint-*"))
    assert checkpoints == sorted([f"checkpoint-{saved_at}", f"checkpoint-{step}"])
    for at in (saved_at, step):
        saved = json.loads((output_dir / f"checkpoint-{at}" / state).read_text())
        assert saved["global_step"] == at
