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
    parse_chunk,
    time_at_step,
    timeline,
)


def iv(
    cause: str,
    start: float,
    end: float,
    *,
    node: str = "n0",
    attempt: str = "a1",
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
        Mark("m1", "n0", "a1", "interrupted", 100, "signal:SIGKILL", 90),
        iv("down", 100, 102),
        iv("restore", 102, 104, attempt="a2"),
        iv("productive", 104, 200, attempt="a2", steps=(70, 166)),
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


def test_one_stalled_node_stalls_the_run() -> None:
    records = [
        iv("productive", 0, 100, node="n0"),
        iv("productive", 0, 100, node="n1"),
        iv("restore", 40, 60, node="n1"),
    ]
    g = goodput(records)
    assert g.seconds["restore"] == 20 and g.seconds["productive"] == 80 and g.nodes == 2


def test_a_chunk_appended_twice_counts_once() -> None:
    records = [iv("productive", 0, 10), Mark("m", "n0", "a1", "commit", 5, "step-10", 10)]
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


def test_a_missing_report_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ckptd.goodput.report import MissingExtra, timeline_html

    monkeypatch.setitem(sys.modules, "plotly", None)
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    with pytest.raises(MissingExtra, match=r"pip install 'ckptd\[report\]'"):
        timeline_html("run1", [iv("productive", 0, 1)], goodput([iv("productive", 0, 1)]))


def test_the_summary_names_each_interruption_and_compares_lost_time() -> None:
    from ckptd.cadence.model import CadencePolicy, History, SaveRecord, advise
    from ckptd.goodput.report import summary_text

    records = merge_records(
        [
            iv("productive", 0, 100, steps=(0, 100)),
            iv("lost", 80, 100, steps=(80, 100)),
            Mark("m", "n0", "a1", "interrupted", 100, "signal:SIGKILL", 100),
        ]
    )
    g = goodput(records)
    history = History("run1", saves=[SaveRecord("step-80", 50.0, 2.0, 3.0, "trainer", False)])
    text = summary_text("run1", g, g, advise(history, CadencePolicy()))
    assert "goodput 80.0 %" in text and "signal:SIGKILL" in text, text
    assert "lost per interruption: measured 20.0 s, expected at the advised interval" in text


# -- the trainer's step report ---------------------------------------------------------------


def test_the_step_report_is_written_at_most_every_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptd.trainer import steps

    monkeypatch.setattr(steps, "_state", {})
    monkeypatch.setenv("CKPTD_WATCH_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("CKPTD_STEP_REPORT_SECONDS", "3600")
    steps.report_step(7)
    steps.report_step(8)  # within the interval: not written
    doc = json.loads((tmp_path / steps.STEPS_RELPATH).read_text())
    assert doc["step"] == 7 and doc["first_step"] == 7 and doc["first_at"] == doc["at"]
    monkeypatch.setenv("CKPTD_STEP_REPORT_SECONDS", "0")
    steps.report_step(9)
    doc = json.loads((tmp_path / steps.STEPS_RELPATH).read_text())
    assert doc["step"] == 9 and doc["first_step"] == 7


def test_the_step_report_is_rank_0s_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptd.trainer import steps

    monkeypatch.setattr(steps, "_state", {})
    monkeypatch.setenv("CKPTD_STEP_REPORT_SECONDS", "0")
    monkeypatch.setenv("CKPTD_WATCH_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    steps.report_step(1)
    assert not (tmp_path / steps.STEPS_RELPATH).exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    blocker = tmp_path / "file"
    blocker.write_text("")
    steps.report_step(2, blocker)  # .ckptd cannot be made under a file: no exception
    monkeypatch.delenv("CKPTD_WATCH_DIR")
    steps.report_step(3)  # no watch dir: nothing to do


def test_a_finished_run_ends_at_its_finished_mark() -> None:
    records = [
        iv("productive", 0, 100),
        Mark("f", "n0", "a1", "finished", 100),
        Mark("c", "n0", "a1", "commit", 104, "step-100"),  # its last upload, after the end
    ]
    g = goodput(records)
    assert g.wall == 100 and g.ratio == 1.0
