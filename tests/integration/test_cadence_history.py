"""The cadence history kept under the run in a real (file) store."""

from __future__ import annotations

from pathlib import Path

from ckptd.cadence.model import History
from ckptd.storage.fs import FileStorage
from ckptd.store.repository import Repository
from tests.unit.test_cadence import _history


def test_the_history_is_never_taken_for_a_checkpoint(tmp_path: Path) -> None:
    repo = Repository(FileStorage(tmp_path))
    repo.write_cadence(_history(2, 100.0))
    assert repo.read_cadence("run") == _history(2, 100.0)
    assert repo.list_names("run") == []
    assert repo.list_committed("run") == []
    assert repo.read_cadence("other") == History("other")
