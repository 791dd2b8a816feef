"""A restore counts as one of the run's interruptions when it downloaded into the run's
watch dir (a fresh node resuming), and not when the checkpoint was already in place or
went anywhere else (a restore tried by hand): one rule
(``ckptd.cadence.model.restore_interruption``) for ``ckptd restore`` and ``ckptd exec``."""

from __future__ import annotations

from pathlib import Path

from ckptd.cadence.advisor import record_restore
from ckptd.cadence.history import read_history
from ckptd.cadence.model import Interruption, restore_interruption
from ckptd.cli.commands.restore import into_watch_dir
from ckptd.config import load_settings
from ckptd.repository import Repository
from ckptd.storage.fs import FileStorage


def test_a_restore_that_downloaded_is_a_restore_interruption_named_by_its_checkpoint() -> None:
    record = restore_interruption(
        "checkpoint-7", skipped=False, resumes=True, at=12.5, node="node-a"
    )
    assert record == Interruption(12.5, "restore", "checkpoint-7", "node-a")


def test_a_restore_that_found_the_checkpoint_in_place_is_no_interruption() -> None:
    assert (
        restore_interruption("checkpoint-7", skipped=True, resumes=True, at=12.5, node="node-a")
        is None
    )


def test_ckptd_restore_records_it_in_the_runs_history_only_when_it_counts(tmp_path: Path) -> None:
    repo = Repository(FileStorage(tmp_path))
    record_restore(repo, "run", "checkpoint-1", skipped=True, resumes=True, now=10.0)
    assert read_history(repo, "run").interruptions == ()
    record_restore(repo, "run", "checkpoint-3", skipped=False, resumes=False, now=15.0)
    assert read_history(repo, "run").interruptions == ()
    record_restore(repo, "run", "checkpoint-2", skipped=False, resumes=True, now=20.0)
    [record] = read_history(repo, "run").interruptions
    assert (record.at, record.kind, record.source) == (20.0, "restore", "checkpoint-2")


def test_a_restore_tried_by_hand_elsewhere_is_no_interruption() -> None:
    """Two test restores into a scratch dir gave "MTBF 8h00m measured" after 7 s."""
    assert (
        restore_interruption("checkpoint-7", skipped=False, resumes=False, at=1.0, node="n") is None
    )


def test_only_the_runs_own_watch_dir_is_a_resume(tmp_path: Path) -> None:
    settings = load_settings(
        None,
        overrides={
            "destination": {"url": f"file://{tmp_path / 'store'}"},
            "watch": [{"dir": str(tmp_path / "ckpt" / "run1"), "run_id": "run1"}],
        },
    )
    assert into_watch_dir(settings, "run1", tmp_path / "ckpt" / "run1")
    assert into_watch_dir(settings, "run1", tmp_path / "ckpt" / "x" / ".." / "run1")
    assert not into_watch_dir(settings, "run1", tmp_path / "scratch")
    assert not into_watch_dir(settings, "run2", tmp_path / "ckpt" / "run1")
