"""A restore counts as one of the run's interruptions when it downloaded (a fresh node
resuming), and not when the checkpoint was already in place: one rule
(``ckptd.cadence.model.restore_interruption``) for ``ckptd restore`` and ``ckptd exec``."""

from __future__ import annotations

from pathlib import Path

from ckptd.cadence.advisor import record_restore
from ckptd.cadence.model import Interruption, restore_interruption
from ckptd.storage.fs import FileStorage
from ckptd.store.repository import Repository


def test_a_restore_that_downloaded_is_a_restore_interruption_named_by_its_checkpoint() -> None:
    record = restore_interruption("checkpoint-7", skipped=False, at=12.5, node="node-a")
    assert record == Interruption(12.5, "restore", "checkpoint-7", "node-a")


def test_a_restore_that_found_the_checkpoint_in_place_is_no_interruption() -> None:
    assert restore_interruption("checkpoint-7", skipped=True, at=12.5, node="node-a") is None


def test_ckptd_restore_records_it_in_the_runs_history_only_when_it_counts(tmp_path: Path) -> None:
    repo = Repository(FileStorage(tmp_path))
    record_restore(repo, "run", "checkpoint-1", skipped=True, now=10.0)
    assert repo.read_cadence("run").interruptions == ()
    record_restore(repo, "run", "checkpoint-2", skipped=False, now=20.0)
    [record] = repo.read_cadence("run").interruptions
    assert (record.at, record.kind, record.source) == (20.0, "restore", "checkpoint-2")
