"""The trainer's step report (``ckptd.trainer.steps``) and the daemon's reading of it
(``ckptd.goodput.step_report``): the memory-mapped counter holds every report, a new
process keeps its predecessor's last one, a half-written report is never believed, and
where the counter cannot be mapped the JSON report takes over at its interval."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.core.handoff import STEP_LAYOUT, StepRecord
from ckptd.goodput.step_report import read_steps
from ckptd.trainer import steps

LAYOUT = STEP_LAYOUT


@pytest.fixture(autouse=True)
def fresh_reporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("CKPTD_STEP_REPORT_SECONDS", raising=False)
    steps._forget()
    yield
    steps._forget()


def counter_bytes(path: Path) -> bytes:
    return (path / steps.STEP_COUNTER_RELPATH).read_bytes()


def test_every_report_is_in_the_counter_at_once(tmp_path: Path) -> None:
    for n in range(5, 12):
        steps.report_step(n, tmp_path)
        got = read_steps(tmp_path).current
        assert got is not None and got.step == n
    assert got.pid == os.getpid() and got.first_step == 5 and got.first_at <= got.at
    stat = Path("/proc/self/stat").read_text()  # this process's start, as the sidecar reads it
    assert got.pid_start == int(stat[stat.rfind(")") + 2 :].split()[19])
    assert len(counter_bytes(tmp_path)) == LAYOUT.SIZE
    assert not (tmp_path / steps.STEPS_RELPATH).exists()  # the fallback is not used


def test_a_new_process_keeps_where_the_last_one_stopped(tmp_path: Path) -> None:
    """The counter left by another process (pid 1, step 40): the next process's first
    report moves it to the previous slot, where a reader that looked too late finds it."""
    data = bytearray(LAYOUT.SIZE)
    data[: LAYOUT.HEADER.size] = LAYOUT.header()
    LAYOUT.RECORD.pack_into(data, LAYOUT.record(0, 9), 9, 40, 100.0, 1, 31, 90.0, 7)
    LAYOUT.SEQ.pack_into(data, LAYOUT.slot(0), 9)
    (tmp_path / ".ckptd").mkdir()
    (tmp_path / steps.STEP_COUNTER_RELPATH).write_bytes(bytes(data))
    assert read_steps(tmp_path).current == StepRecord(40, 100.0, 1, 31, 90.0, 7)
    steps.report_step(31, tmp_path)
    reports = read_steps(tmp_path)
    assert reports.current is not None and reports.current.step == 31
    assert reports.previous == StepRecord(40, 100.0, 1, 31, 90.0, 7)


def test_a_report_cut_short_leaves_the_one_before(tmp_path: Path) -> None:
    """A writer killed between the record and the sequence word: the word still names the
    last whole record, so the reader takes that one, never the half-written one."""
    steps.report_step(7, tmp_path)
    steps.report_step(8, tmp_path)
    path = tmp_path / steps.STEP_COUNTER_RELPATH
    data = bytearray(path.read_bytes())
    # Report 3 (step 9) written into its record, half of it: the tag, step 9, no time.
    LAYOUT.RECORD.pack_into(data, LAYOUT.record(0, 3), 3, 9, 0.0, 0, 0, 0.0, 0)
    path.write_bytes(bytes(data))
    got = read_steps(tmp_path).current
    assert got is not None and got.step == 8


def test_a_record_the_sequence_word_does_not_name_is_not_believed(tmp_path: Path) -> None:
    steps.report_step(3, tmp_path)
    path = tmp_path / steps.STEP_COUNTER_RELPATH
    data = bytearray(path.read_bytes())
    (seq,) = LAYOUT.SEQ.unpack_from(data, LAYOUT.slot(0))
    LAYOUT.SEQ.pack_into(data, LAYOUT.slot(0), seq + 2)  # names a record not written
    path.write_bytes(bytes(data))
    assert read_steps(tmp_path).current is None
    path.write_bytes(b"CKPTDSTP" + bytes(LAYOUT.SIZE - 8))  # a format word of another
    assert read_steps(tmp_path).current is None
    path.write_bytes(b"junk")
    assert read_steps(tmp_path).current is None


def test_a_file_that_is_no_counter_is_made_one(tmp_path: Path) -> None:
    (tmp_path / ".ckptd").mkdir()
    (tmp_path / steps.STEP_COUNTER_RELPATH).write_bytes(b"x" * 1000)
    steps.report_step(2, tmp_path)
    got = read_steps(tmp_path).current
    assert got is not None and got.step == 2
    assert len(counter_bytes(tmp_path)) == LAYOUT.SIZE


def test_where_the_counter_cannot_be_mapped_the_json_report_takes_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / steps.STEP_COUNTER_RELPATH).mkdir(parents=True)  # cannot be opened
    monkeypatch.setenv("CKPTD_STEP_REPORT_SECONDS", "3600")
    steps.report_step(7, tmp_path)
    steps.report_step(8, tmp_path)  # within the interval: not written
    doc = json.loads((tmp_path / steps.STEPS_RELPATH).read_text())
    assert doc["step"] == 7 and doc["first_step"] == 7 and doc["first_at"] == doc["at"]
    got = read_steps(tmp_path).current
    assert got is not None and (got.step, got.first_step) == (7, 7)
    steps._forget()
    monkeypatch.setenv("CKPTD_STEP_REPORT_SECONDS", "0")
    steps.report_step(9, tmp_path)
    steps.report_step(10, tmp_path)
    assert json.loads((tmp_path / steps.STEPS_RELPATH).read_text())["step"] == 10


def test_the_newer_of_the_counter_and_a_json_report_is_read(tmp_path: Path) -> None:
    steps.report_step(4, tmp_path)
    counted = read_steps(tmp_path).current
    assert counted is not None
    body = {"step": 50, "at": counted.at + 1, "pid": 2, "first_step": 41, "first_at": 1.0}
    (tmp_path / steps.STEPS_RELPATH).write_text(json.dumps(body))
    assert read_steps(tmp_path).current == StepRecord(50, counted.at + 1, 2, 41, 1.0)
    body["at"] = counted.at - 1
    (tmp_path / steps.STEPS_RELPATH).write_text(json.dumps(body))
    assert read_steps(tmp_path).current == counted


def test_the_report_is_rank_0s_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_WATCH_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    steps.report_step(1)
    assert not (tmp_path / ".ckptd").exists()
    steps._forget()
    monkeypatch.setenv("LOCAL_RANK", "0")
    blocker = tmp_path / "file"
    blocker.write_text("")
    steps.report_step(2, blocker)  # .ckptd cannot be made under a file: no exception
    steps._forget()
    monkeypatch.delenv("CKPTD_WATCH_DIR")
    steps.report_step(3)  # no watch dir: nothing to do
    assert read_steps(tmp_path).current is None


def test_without_a_watch_dir_it_reports_where_the_listener_watches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside ``ckptd run`` no ``CKPTD_WATCH_DIR`` need be set: the dir the trainer gave
    ``ckptd.trainer.install`` (or a callback's) is where the steps go, even when it was
    given after the first report."""
    import ckptd.trainer

    monkeypatch.delenv("CKPTD_WATCH_DIR", raising=False)
    steps.report_step(1)  # no dir anywhere yet: nothing
    ckptd.trainer.install(tmp_path)
    try:
        steps.report_step(2)
    finally:
        ckptd.trainer.uninstall()
    got = read_steps(tmp_path).current
    assert got is not None and (got.step, got.first_step) == (2, 2)
