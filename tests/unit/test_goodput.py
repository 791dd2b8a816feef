"""The run ledger and goodput (``ckptd.goodput.model``): causes tile the wall time, a chunk
appended twice counts once, lost progress from step samples, garbage is skipped."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.goodput.model import (
    ABANDONED_SECONDS,
    CAUSES,
    FORMAT,
    PRECEDENCE,
    UNKNOWN,
    Interval,
    Mark,
    chunk_bytes,
    goodput,
    lost_span,
    merge_records,
    notice_cause,
    parse_chunk,
    parse_record,
    run_end,
    time_at_step,
    timeline,
)


def iv(
    cause: str,
    start: float,
    end: float,
    *,
    node: str = "n0",
    attempt: str = "w/1",
    rid: str | None = None,
    steps: tuple[int, int] | None = None,
) -> Interval:
    return Interval(
        rid or f"{node}:{cause}:{start}",
        node,
        attempt,
        cause,
        start,
        end,
        "test",
        *(steps or (None, None)),
    )


def test_one_attempt_adds_up() -> None:
    records = [
        iv("startup", 0, 10),
        iv("productive", 10, 100, steps=(0, 90)),
        iv("save", 50, 55),  # carved out of the productive span
        iv("lost", 80, 100, steps=(70, 90)),
        Mark("m1", "n0", "w/1", "interrupted", 100, "signal:SIGKILL", 90),
        iv("down", 100, 102),
        iv("restore", 102, 104, attempt="w/2"),
        iv("productive", 104, 200, attempt="w/2", steps=(70, 166)),
    ]
    g = goodput(records)
    assert g.wall == 200
    assert g.seconds["productive"] == pytest.approx(90 - 5 - 20 + 96)
    assert g.seconds["save"] == 5 and g.seconds["lost"] == 20 and g.seconds[UNKNOWN] == 0
    assert sum(g.seconds.values()) == pytest.approx(g.wall)
    assert g.ratio == pytest.approx(161 / 200)
    (interrupted,) = g.interruptions
    assert interrupted.lost_steps == 20 and interrupted.lost_seconds == 20
    assert g.attempts == 2 and g.nodes == 1


def test_time_no_record_covers_is_unknown_not_zero_and_not_productive() -> None:
    g = goodput([iv("productive", 0, 10), iv("productive", 30, 40)])
    assert g.seconds[UNKNOWN] == 20 and g.seconds["productive"] == 20
    assert g.ratio == 0.5


def test_a_live_run_counts_until_now_and_the_last_day_is_a_window() -> None:
    records = [iv("productive", 0, 100)]
    assert goodput(records, until=150).seconds[UNKNOWN] == 50
    day = goodput(records, until=150, since=80)
    assert day.wall == 70 and day.seconds["productive"] == 20
    # A reader's now: the writer (w, no stop marked, last record 50 s old) may be live.
    assert goodput(records, now=150).seconds[UNKNOWN] == 50


def test_one_stalled_node_stalls_the_run() -> None:
    records = [
        iv("productive", 0, 100, node="n0"),
        iv("productive", 0, 100, node="n1"),
        iv("restore", 40, 60, node="n1"),
    ]
    g = goodput(records)
    assert g.seconds["restore"] == 20 and g.seconds["productive"] == 80 and g.nodes == 2


def test_a_chunk_appended_twice_counts_once() -> None:
    records = [iv("productive", 0, 10), Mark("m", "n0", "w/1", "commit", 5, "step-10", 10)]
    body = chunk_bytes("run1", "w", records)
    merged = merge_records(parse_chunk(body), parse_chunk(body))
    assert merged == merge_records(records)
    assert goodput(merged).seconds["productive"] == 10


def test_garbage_chunks_and_records_are_skipped() -> None:
    assert parse_chunk(b"not json") == []
    assert parse_chunk(json.dumps({"format": "other/1", "records": []}).encode()) == []
    good = iv("productive", 0, 1).to_json()
    bad = [
        {**good, "id": "x1", "cause": "nap"},
        {**good, "id": "x2", "end": -1},
        {**good, "id": "x3", "start": 5, "end": 1},
        {**good, "id": "x4", "start": float("nan")},
        {"type": "mark", "id": "x5", "node": "n", "attempt": "a", "kind": "lunch", "at": 1},
        "text",
    ]
    body = json.dumps({"format": FORMAT, "records": [good, *bad]}).encode()
    assert [r.id for r in parse_chunk(body)] == [good["id"]]


def test_lost_progress_from_step_samples() -> None:
    samples = [(10.0, 0), (20.0, 10), (30.0, 20), (40.0, 30)]
    assert time_at_step(samples, 15) == 25.0
    assert time_at_step(samples, 31) is None
    assert lost_span(samples, 20, 42.0) == (30.0, 20, 30)
    assert lost_span(samples, 30, 42.0) is None  # resumed where it was: nothing lost
    assert lost_span([], 0, 1.0) is None


# -- properties -----------------------------------------------------------------------------

times = st.floats(min_value=0, max_value=1000, allow_nan=False)
interval_st = st.builds(
    lambda c, a, b, n: iv(c, min(a, b), max(a, b), node=n, rid=f"{n}:{c}:{a}:{b}"),
    st.sampled_from(sorted(CAUSES)),
    times,
    times,
    st.sampled_from(["n0", "n1", "n2"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(interval_st, max_size=30), st.one_of(st.none(), times))
def test_causes_always_sum_to_the_wall_time(records: list[Interval], until: float | None) -> None:
    g = goodput(records, until=until)
    assert sum(g.seconds.values()) == pytest.approx(g.wall, abs=1e-6)
    assert all(s >= 0 for s in g.seconds.values())
    if g.ratio is not None:
        assert 0 <= g.ratio <= 1 + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.lists(interval_st, max_size=20), st.data())
def test_an_interrupted_append_never_double_counts(
    records: list[Interval], data: st.DataObject
) -> None:
    """A writer killed after shipping a chunk but before noting it ships it again (in a
    new chunk, maybe with later records): the ledger reads as if shipped once."""
    cut = data.draw(st.integers(0, len(records)))
    first = parse_chunk(chunk_bytes("r", "w", records[:cut]))
    again = parse_chunk(chunk_bytes("r", "w", records))
    once = goodput(merge_records(parse_chunk(chunk_bytes("r", "w", records))))
    twice = goodput(merge_records(first, again))
    assert twice.seconds == once.seconds


@settings(max_examples=100, deadline=None)
@given(st.lists(interval_st, max_size=20))
def test_segments_tile_and_take_the_highest_precedence(records: list[Interval]) -> None:
    if not records:
        return
    lo, hi = min(r.start for r in records), max(r.end for r in records)
    segs = timeline(records, lo, hi)
    for a, b in itertools.pairwise(segs):
        assert a.end == b.start and a.cause != b.cause
    for seg in segs:
        mid = (seg.start + seg.end) / 2
        # A segment 1 ulp wide has no float strictly inside: its midpoint rounds to an
        # end, and [start, end) is then probed at its start.
        probe = mid if seg.start < mid < seg.end else seg.start
        covering = [r.cause for r in records if r.start <= probe < r.end]
        expected = min(covering, key=PRECEDENCE.index) if covering else UNKNOWN
        assert seg.cause == expected


def test_the_status_line_shows_goodput_and_the_worst_causes() -> None:
    from ckptd.cli.statusview import goodput_text

    g = goodput([iv("startup", 0, 10), iv("productive", 10, 90), iv("lost", 75, 90)])
    line = goodput_text({"run": g.to_json(), "last_24h": g.to_json()})
    assert line is not None
    assert str(line).startswith("goodput: 72.2 % (last 24 h 72.2 %)"), str(line)
    assert "badput lost 15 s, startup 10 s" in str(line)
    assert goodput_text(None) is None and goodput_text({"run": {}}) is None


def test_no_step_reports_is_said_where_goodput_shows_and_not_otherwise() -> None:
    """A trainer that follows the README without ``report_step``: its time reads as
    startup and goodput as 0 %; the report, the JSON and ``ckptd status`` say why and
    how to add them. One that reports steps gets no such line."""
    from ckptd.cli.statusview import goodput_text
    from ckptd.goodput.report import NO_STEPS_HINT, summary_text

    silent = goodput([iv("startup", 0, 100)])
    assert silent.ratio == 0.0 and silent.to_json()["no_step_reports"] is True
    assert NO_STEPS_HINT in summary_text("run1", silent, silent, None)
    shown = goodput_text({"run": silent.to_json()})
    assert shown is not None and "report_step" in str(shown)
    counted = goodput([iv("startup", 0, 10), iv("productive", 10, 100, steps=(0, 90))])
    assert counted.to_json()["no_step_reports"] is False
    assert "report_step" not in summary_text("run1", counted, counted, None)
    assert "report_step" not in str(goodput_text({"run": counted.to_json()}))


def test_a_missing_report_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ckptd.goodput.report import MissingExtra, timeline_html

    monkeypatch.setitem(sys.modules, "plotly", None)
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    with pytest.raises(MissingExtra, match=r"pip install 'plotly>=6' \(or, in ckptd's checkout"):
        timeline_html("run1", [iv("productive", 0, 1)], goodput([iv("productive", 0, 1)]))


def test_the_summary_names_each_interruption_and_compares_lost_time() -> None:
    from ckptd.cadence.model import CadencePolicy, History, SaveRecord, advise
    from ckptd.goodput.report import summary_text

    records = merge_records(
        [
            iv("productive", 0, 100, steps=(0, 100)),
            iv("lost", 80, 100, steps=(80, 100)),
            Mark("m", "n0", "w/1", "interrupted", 100, "signal:SIGKILL", 100),
        ]
    )
    g = goodput(records)
    history = History("run1", saves=[SaveRecord("step-80", 50.0, 2.0, 3.0, "trainer", False)])
    text = summary_text("run1", g, g, advise(history, CadencePolicy()))
    assert "goodput 80.0 %" in text and "signal:SIGKILL" in text, text
    assert "lost per interruption: measured 20.0 s, expected at the advised interval" in text


def test_a_finished_run_ends_at_its_finished_mark() -> None:
    records = [
        iv("productive", 0, 100),
        Mark("f", "n0", "w/1", "finished", 100),
        Mark("c", "n0", "w/1", "commit", 104, "step-100"),  # its last upload, after the end
    ]
    g = goodput(records)
    assert g.wall == 100 and g.ratio == 1.0


def test_training_after_a_finished_mark_goes_on_counting() -> None:
    """A finished run resumed for more steps: its end is no longer the old mark."""
    records = [
        iv("productive", 0, 100),
        Mark("f", "n0", "w/1", "finished", 100),
        iv("productive", 200, 300, attempt="v/1", rid="v:1"),
    ]
    g = goodput(records)
    assert g.wall == 300 and g.seconds[UNKNOWN] == 100


def test_attempts_count_trainer_starts_not_what_came_before_the_first() -> None:
    """A fresh node's ledger gap, restore and start-up before its trainer starts belong to
    its writer (attempt "v"), not to an attempt of their own."""
    records = [
        iv("startup", 0, 5, attempt="w"),
        iv("productive", 5, 50, attempt="w/1"),
        iv("productive", 52, 100, attempt="w/2"),
        iv("down", 100, 160, attempt="v", node="n1"),
        iv("restore", 160, 170, attempt="v", node="n1"),
        iv("productive", 172, 200, attempt="v/1", node="n1"),
    ]
    g = goodput(records)
    assert g.attempts == 3 and g.nodes == 2


def ended(kind: str, at: float, writer: str = "w") -> Mark:
    return Mark(f"{writer}:m{at}", "n0", f"{writer}/1", kind, at)


def test_a_stopped_run_stops_accruing_unknown() -> None:
    """The writer marked its stop (a notice flushed, the daemon stopped): a reader at any
    later time sees the run end at its last record, goodput unchanged."""
    records = [
        iv("productive", 0, 90, rid="w:1"),
        iv("wait_commit", 90, 95, rid="w:2"),
        ended("stopped", 95),
    ]
    for now in (96.0, 130.0, 10_000.0):
        g = goodput(records, now=now)
        assert g.end == 95 and g.seconds[UNKNOWN] == 0 and g.ratio == pytest.approx(90 / 95)
    assert run_end(records, 10_000.0) == 95


def test_an_abandoned_run_ends_at_its_last_record_after_the_documented_time() -> None:
    """A writer killed with its node marks nothing: unknown grows until its last record
    is ABANDONED_SECONDS old, and then the run ends at that record."""
    records = [iv("productive", 0, 100, rid="w:1")]
    live = goodput(records, now=100 + ABANDONED_SECONDS - 1)
    assert live.seconds[UNKNOWN] == ABANDONED_SECONDS - 1
    gone = goodput(records, now=100 + ABANDONED_SECONDS)
    assert gone.end == 100 and gone.seconds[UNKNOWN] == 0 and gone.ratio == 1.0
    # A second writer still recording keeps the run live, whatever the first one did.
    both = [*records, ended("stopped", 100), iv("productive", 300, 400, rid="v:1")]
    assert run_end(both, 450.0) == 450.0
    assert run_end([*both, ended("stopped", 400, "v")], 450.0) == 400


def test_a_finished_run_ends_there_whoever_reads_it() -> None:
    records = [iv("productive", 0, 100), ended("finished", 100)]
    assert goodput(records, now=5_000).end == 100
    assert goodput(records, until=5_000).end == 100  # its own writer, still shipping


def test_the_restores_recorded_in_a_watch_dir_are_read_and_garbage_is_none(
    tmp_path: Path,
) -> None:
    """The daemon beside the trainer reads what ``ckptd restore`` recorded (its format:
    ckptd.store.restore.record): this run's entries with both times, oldest first."""
    from ckptd.goodput.restored import RESTORED_RELPATH, RestoreRecord, read_restores

    entry = {"run": "run1", "slot": "step-40", "step": 40, "began_at": 100.0}
    doc = {
        "step-40": {**entry, "restored_at": 104.5, "files": {}},
        "step-20": {**entry, "step": 20, "began_at": 50.0, "restored_at": 51.0},
        "other": {**entry, "run": "run2", "restored_at": 104.5},  # another run's
        "old": {k: v for k, v in entry.items() if k != "began_at"} | {"restored_at": 9.0},
        "backwards": {**entry, "restored_at": 99.0},
        "odd-step": {**entry, "step": "x", "began_at": 60.0, "restored_at": 61.0},
        "junk": "text",
    }
    (tmp_path / ".ckptd").mkdir()
    (tmp_path / RESTORED_RELPATH).write_text(json.dumps(doc))
    assert read_restores(tmp_path, "run1") == [
        RestoreRecord("run1", "step-20", 20, 50.0, 51.0),
        RestoreRecord("run1", "odd-step", None, 60.0, 61.0),
        RestoreRecord("run1", "step-40", 40, 100.0, 104.5),
    ]
    (tmp_path / RESTORED_RELPATH).write_text("{")
    assert read_restores(tmp_path, "run1") == []


def test_a_health_stop_is_an_interruption_of_its_own_and_old_ledgers_read_as_before() -> None:
    assert notice_cause("health") == notice_cause("node-0/health") == "health"
    assert notice_cause("aws") == notice_cause("sigterm") == notice_cause("node-1/gcp") == "notice"
    assert notice_cause("healthz") == "notice"
    # One ledger chunk with both causes, as written before and after ``health`` existed.
    body = chunk_bytes(
        "run1",
        "w",
        [
            iv("productive", 0, 10, attempt="w/1"),
            Mark("m1", "n0", "w/1", "interrupted", 10.0, "notice", 5),
            iv("productive", 20, 30, attempt="w/2"),
            Mark("m2", "n0", "w/2", "interrupted", 30.0, "health", 9),
        ],
    )
    records = parse_chunk(body)
    assert [i.cause for i in goodput(records, now=30.0).interruptions] == ["notice", "health"]


def test_a_restore_interval_keeps_where_its_bytes_came_from_and_older_ones_read_as_before() -> None:
    iv = Interval("w:1", "node-0", "w", "restore", 10.0, 20.0, "exec-restore", None, None, 7, 3)
    doc = json.loads(json.dumps(iv.to_json()))
    assert doc["bytes"] == {"peer": 7, "store": 3}
    back = parse_record(doc)
    assert isinstance(back, Interval) and (back.peer_bytes, back.store_bytes) == (7, 3)
    older = {k: v for k, v in doc.items() if k != "bytes"}
    back = parse_record(older)
    assert isinstance(back, Interval) and (back.peer_bytes, back.store_bytes) == (None, None)
    assert "bytes" not in Interval("w:2", "n", "w", "restore", 1.0, 2.0, "x").to_json()
    garbled = parse_record({**doc, "bytes": {"peer": -1, "store": "many"}})
    assert isinstance(garbled, Interval) and garbled.peer_bytes is None
