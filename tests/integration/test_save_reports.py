"""The trainer's save reports (``ckptd.core.saves``): a checkpoint every local rank reported
finished is complete at once, without its layout's quiet window, and only then.

The end-to-end test runs the daemon as a real process with a long quiet window and
measures, from its own ``checkpoint_committed`` events, which checkpoints waited for it.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ckptd import layouts
from ckptd.core import saves
from ckptd.layouts.base import CheckpointListing, FileEntry, RuleSettings
from ckptd.sync.scanner import snapshot
from ckptd.trainer import report_save
from tests.support.daemon import Daemon, wait_until
from tests.support.writers import write_bytes

NS = 1_000_000_000
MiB = 1024 * 1024


def _report(**fields: Any) -> dict[str, Any]:
    return {"checkpoint": "checkpoint-5", **fields}


# -- which reports count (pure) -----------------------------------------------------------


def test_a_report_made_after_the_save_began_counts() -> None:
    reports = [_report(at=100.0, save_seconds=2.0)]
    assert saves.saved_at_ns(reports, "checkpoint-5", 5, oldest_mtime_ns=98 * NS) == 100 * NS


def test_a_report_older_than_the_checkpoints_files_is_an_earlier_saves() -> None:
    reports = [_report(at=100.0)]
    assert saves.saved_at_ns(reports, "checkpoint-5", 5, oldest_mtime_ns=101 * NS) is None


def test_every_local_rank_must_report() -> None:
    rank0 = _report(at=100.0, rank=0, ranks=2)
    rank1 = _report(at=100.5, rank=1, ranks=2)
    assert saves.saved_at_ns([rank0], "checkpoint-5", 5, 90 * NS) is None
    assert saves.saved_at_ns([rank0, rank1], "checkpoint-5", 5, 90 * NS) == int(100.5 * NS)


def test_reports_match_by_name_else_by_step_and_ignore_junk() -> None:
    reports: list[dict[str, Any]] = [
        {"step": 5, "at": 100.0},  # names no checkpoint: matched by step
        _report(at="soon"),
        _report(at=True),
        {"checkpoint": "checkpoint-6", "at": 200.0},
    ]
    assert saves.saved_at_ns(reports, "checkpoint-5", 5, 90 * NS) == 100 * NS
    assert saves.saved_at_ns(reports, "step-7", 7, 90 * NS) is None


def _hf(saved_at: float | None, writers: frozenset[str] = frozenset()) -> CheckpointListing:
    return CheckpointListing(
        name="checkpoint-5",
        is_dir=True,
        files=(
            FileEntry("model.safetensors", 10, 99 * NS),
            FileEntry("trainer_state.json", 10, 100 * NS),
        ),
        open_for_write=writers,
        saved_at_ns=None if saved_at is None else int(saved_at * NS),
    )


def test_the_rule_skips_its_quiet_window_on_a_report_after_the_last_write() -> None:
    settings = RuleSettings(settle_seconds=30.0)
    now = int(100.5 * NS)  # half a second after the last write
    assert not layouts.evaluate("hf", _hf(None), now, settings).complete
    assert layouts.evaluate("hf", _hf(100.2), now, settings).complete
    # A file written after the report is a new save: the window applies again.
    assert not layouts.evaluate("hf", _hf(99.5), now, settings).complete
    # A file still open for writing is never complete, report or not.
    busy = _hf(100.2, writers=frozenset({"model.safetensors"}))
    assert not layouts.evaluate("hf", busy, now, settings).complete


def test_the_scanner_reads_the_trainers_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "checkpoint-5"
    write_bytes(ckpt / "model.safetensors", 1024)
    (ckpt / "trainer_state.json").write_text("{}")
    listing = snapshot(tmp_path, "checkpoint-5")
    assert listing is not None and listing.saved_at_ns is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    report_save(tmp_path, checkpoint="checkpoint-5", seconds=0.5)
    listing = snapshot(tmp_path, "checkpoint-5")
    assert listing is not None and listing.saved_at_ns is None  # rank 0 has not reported
    monkeypatch.setenv("LOCAL_RANK", "0")
    report_save(tmp_path, checkpoint="checkpoint-5", seconds=0.5)
    listing = snapshot(tmp_path, "checkpoint-5")
    assert listing is not None and listing.saved_at_ns is not None
    assert listing.saved_at_ns >= listing.newest_mtime_ns
    lines = (tmp_path / saves.RELPATH).read_text().splitlines()
    assert [json.loads(line)["rank"] for line in lines] == [1, 0]


# -- end to end ---------------------------------------------------------------------------


def _committed_at(daemon: Daemon, name: str) -> float:
    event = wait_until(
        lambda: daemon.events_named("checkpoint_committed", checkpoint=name), 60, name
    )[0]
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _save(root: Path, name: str) -> float:
    """An HF-shaped save; returns the newest mtime among its files."""
    write_bytes(root / name / "model.safetensors", 2 * MiB)
    state = root / name / "trainer_state.json"
    state.write_text('{"global_step": 1}')
    return max(p.stat().st_mtime for p in (root / name).iterdir())


def test_a_reported_checkpoint_commits_without_waiting_out_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settle = 8.0
    root = tmp_path / "run"
    root.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": root, "settle_seconds": settle, "layout": "hf"}],
        dest=f"file://{tmp_path / 'store'}",
        state_dir=tmp_path / "state",
    )
    with daemon:
        # Reported, and nothing written after the report: committed at once.
        _save(root, "checkpoint-1")
        reported = os.path.getmtime(root / "checkpoint-1" / "trainer_state.json")
        report_save(root, checkpoint="checkpoint-1")
        assert _committed_at(daemon, "checkpoint-1") - reported < settle / 2
        # A file rewritten after the report: a new save, which waits out the window.
        _save(root, "checkpoint-2")
        report_save(root, checkpoint="checkpoint-2")
        rewritten = _save(root, "checkpoint-2")
        # One rank of two reported: the other may still be writing, so the window.
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", "0")
        half = _save(root, "checkpoint-3")
        report_save(root, checkpoint="checkpoint-3")
        assert _committed_at(daemon, "checkpoint-2") - rewritten >= settle - 0.05
        assert _committed_at(daemon, "checkpoint-3") - half >= settle - 0.05
    assert (tmp_path / "store" / "run" / "checkpoint-1" / "ckptd.manifest.json").is_file()
