"""The cadence history kept under the run in a real (file) store."""

from __future__ import annotations

from pathlib import Path

from ckptd.cadence.history import read_history, write_history
from ckptd.cadence.model import History
from ckptd.repository import Repository
from ckptd.storage.fs import FileStorage
from tests.unit.test_cadence import _history


def test_the_history_is_never_taken_for_a_checkpoint(tmp_path: Path) -> None:
    repo = Repository(FileStorage(tmp_path))
    write_history(repo, _history(2, 100.0))
    assert read_history(repo, "run") == _history(2, 100.0)
    assert repo.list_names("run") == []
    assert repo.list_committed("run") == []
    assert read_history(repo, "other") == History("other")
