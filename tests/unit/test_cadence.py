"""The cadence advice: Young/Daly's interval and its edges (property tests), the expected
cost, learning the interruption rate, and the trainer helper (the history kept in the store:
tests/integration/test_cadence_history.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.cadence.advisor import reported_save_seconds
from ckptd.cadence.model import (
    Bounds,
    CadencePolicy,
    History,
    Interruption,
    SaveRecord,
    advise,
    advised_interval,
    costly_interruptions,
    count_interruptions,
    current_interval,
    daly_interval,
    estimate_mtbf,
    expected_cost,
    learn_cadence,
    merge_history,
    parse_history,
    quick_repeats,
    restart_interval,
    young_interval,
)
from ckptd.trainer.cadence import AdvisedCadence, advice_url, parse_advice

seconds = st.floats(min_value=1e-3, max_value=1e7, allow_nan=False, allow_infinity=False)


# -- the formula ---------------------------------------------------------------------------


@given(c=seconds, m=seconds, factor=st.floats(min_value=1.0, max_value=100.0))
def test_interval_grows_with_the_save_cost_and_with_the_mtbf(
    c: float, m: float, factor: float
) -> None:
    assert daly_interval(c * factor, m) >= daly_interval(c, m) * (1 - 1e-9)
    assert daly_interval(c, m * factor) >= daly_interval(c, m) * (1 - 1e-9)
    bounds = Bounds(60.0, 6 * 3600.0)
    # The same one-part-in-a-billion slack as Daly's: a larger input may round one ulp lower.
    base = advised_interval(c, m, 0, bounds) * (1 - 1e-9)
    assert advised_interval(c * factor, m, 0, bounds) >= base
    assert advised_interval(c, m * factor, 0, bounds) >= base


@given(c=st.floats(min_value=1e-3, max_value=100.0), m=st.floats(min_value=1e6, max_value=1e9))
def test_reduces_to_youngs_closed_form_when_saves_are_cheap(c: float, m: float) -> None:
    young = young_interval(c, m)
    assert young == pytest.approx(math.sqrt(2 * c * m) - c)
    # Daly's higher-order terms add C/3 and less: vanishing against sqrt(2CM) as C/M -> 0.
    assert daly_interval(c, m) == pytest.approx(young, rel=0.01)


@given(c=seconds, m=seconds)
def test_at_and_past_c_equals_2m_the_interval_is_8m_over_9_and_never_negative(
    c: float, m: float
) -> None:
    t = daly_interval(c, m)
    assert t >= 0
    if c >= 2 * m:
        assert t == pytest.approx(8 * m / 9)
    else:
        assert t <= 8 * m / 9 * (1 + 1e-9)


def test_the_advice_is_continuous_at_c_equals_2m() -> None:
    m = 1000.0
    assert daly_interval(2 * m - 1e-6, m) == pytest.approx(daly_interval(2 * m + 1e-6, m))


def test_a_free_save_or_no_measurement_is_bounded_below() -> None:
    assert daly_interval(0.0, 3600.0) == 0.0
    assert advised_interval(0.0, 3600.0, 0.0, Bounds(60.0, 3600.0)) == 60.0


def test_the_interval_never_outruns_the_uploader_nor_exceeds_the_ceiling() -> None:
    bounds = Bounds(1.0, 600.0)
    assert advised_interval(1.0, 100.0, upload_seconds=300.0, bounds=bounds) == 299.0
    assert advised_interval(60.0, 1e9, bounds=bounds) == 600.0


@given(c=st.floats(min_value=0.1, max_value=600.0), m=st.floats(min_value=3600.0, max_value=1e7))
@settings(max_examples=50)
def test_the_advised_interval_is_near_the_minimum_of_the_expected_cost(c: float, m: float) -> None:
    best = min(expected_cost(t, c, m).total_fraction for t in (c * 1.05**k for k in range(400)))
    advised = expected_cost(daly_interval(c, m), c, m).total_fraction
    assert advised <= best * 1.02 + 1e-12


def test_expected_cost_worked_example() -> None:
    # C = 60 s, M = 24 h: Young's T = sqrt(2*60*86400) - 60 = 3160 s.
    cost = expected_cost(3160.0, 60.0, 86400.0, upload_seconds=120.0)
    assert cost.save_fraction == pytest.approx(60 / 3220)
    assert cost.lost_work_fraction == pytest.approx((3220 / 2 + 120) / 86400)
    assert cost.to_json()["lost_work_seconds_per_hour"] == pytest.approx(
        3600 * (3220 / 2 + 120) / 86400, abs=0.01
    )


# -- learning the interruption rate ------------------------------------------------------


def test_one_preemption_seen_three_ways_is_one_interruption() -> None:
    # notice at t, the restart 40 s later, the restore on a new node 5 min later; then another.
    assert count_interruptions([1000.0, 1040.0, 1300.0, 9000.0], merge_seconds=600) == 2
    assert count_interruptions([], 600) == 0


@given(
    observed=st.floats(min_value=0, max_value=1e8),
    n=st.integers(min_value=0, max_value=10_000),
    prior=st.floats(min_value=60, max_value=1e7),
)
def test_mtbf_starts_at_the_prior_and_falls_with_each_interruption(
    observed: float, n: int, prior: float
) -> None:
    assert estimate_mtbf(0.0, 0, prior) == pytest.approx(prior)
    assert estimate_mtbf(observed, n + 1, prior) < estimate_mtbf(observed, n, prior)
    assert estimate_mtbf(observed + 3600, n, prior) > estimate_mtbf(observed, n, prior)


def test_a_bursts_later_blows_do_not_shorten_the_interval() -> None:
    # Four bursts of three interruptions ten minutes apart, over four weeks.
    bursts = [week * 7 * 86400.0 + k * 600.0 for week in range(4) for k in range(3)]
    assert costly_interruptions(bursts, interval=1800.0) == 4
    assert costly_interruptions(bursts, interval=300.0) == 12
    assert costly_interruptions([], 300.0) == 0
    policy = CadencePolicy(merge_seconds=60.0)
    interval, mtbf, counted = learn_cadence(bursts, 28 * 86400.0, 30.0, 0.0, policy)
    assert counted == 4
    assert mtbf == pytest.approx(estimate_mtbf(28 * 86400.0, 4))
    spread = [k * 7 * 86400.0 / 3 for k in range(12)]  # as many, evenly spread
    assert interval > learn_cadence(spread, 28 * 86400.0, 30.0, 0.0, policy)[0]


# -- after a restart ----------------------------------------------------------------------


def _bursts(gap: float) -> list[float]:
    """Four bursts of three interruptions ``gap`` apart, a week apart."""
    return [week * 7 * 86400.0 + k * gap for week in range(4) for k in range(3)]


def test_after_a_restart_a_bursty_run_saves_first_after_its_quick_repeats_mean_gap() -> None:
    bursts = _bursts(1200.0)
    policy = CadencePolicy(merge_seconds=600.0)
    interval, _, counted = learn_cadence(bursts, 28 * 86400.0, 30.0, 60.0, policy)
    assert counted == 4 and interval > 1200.0
    assert quick_repeats(bursts, interval) == [1200.0] * 8
    # p = 8/12 of restarts followed by a repeat, g = 1200 s: an early save keeps
    # p g exp(-1 - 90/g) = 273 s on average, for a save of 30 s.
    assert restart_interval(bursts, interval, 30.0, 60.0) == pytest.approx(1200.0)
    history = History(
        "run",
        28 * 86400.0,
        tuple(SaveRecord(f"c-{k}", 3600.0 * k, 30.0, 60.0, "trainer") for k in range(4)),
        tuple(Interruption(at, "notice", "aws") for at in bursts),
    )
    advice = advise(history, policy)
    assert advice.interval_seconds == pytest.approx(interval)
    assert advice.restart_interval_seconds == pytest.approx(1200.0)
    assert advice.quick_repeats == 8 and advice.costly_interruptions == 4
    assert advice.to_json()["restart_interval_seconds"] == pytest.approx(1200.0)


def test_without_bursts_or_when_an_early_save_costs_more_it_keeps_the_interval() -> None:
    interval = 6000.0
    assert restart_interval([], interval, 30.0, 60.0) == interval
    spread = [k * 86400.0 for k in range(20)]  # no gap within an interval
    assert restart_interval(spread, interval, 30.0, 60.0) == interval
    # One quick repeat in 21 interruptions: p g exp(-1 - 90/g) ~ 19 s < a 30 s save.
    one = sorted([*spread, 5 * 86400.0 + 1200.0])
    assert restart_interval(one, interval, 30.0, 60.0) == interval
    assert restart_interval(one, interval, 10.0, 60.0) == pytest.approx(1200.0)
    # Repeats every burst, but saves as slow as the gap: not worth it.
    assert restart_interval(_bursts(1200.0), interval, 600.0, 60.0) == interval
    # Never below the floor.
    assert restart_interval(_bursts(100.0), interval, 1.0, 0.0, Bounds(300.0, 6000.0)) == 300.0


@given(
    gaps=st.lists(st.floats(min_value=1.0, max_value=1e6), min_size=0, max_size=30),
    interval=st.floats(min_value=60.0, max_value=6 * 3600.0),
    c=st.floats(min_value=0.0, max_value=3600.0),
    u=st.floats(min_value=0.0, max_value=3600.0),
    factor=st.floats(min_value=1.0, max_value=100.0),
)
def test_the_restart_interval_is_bounded_by_the_interval_and_grows_with_the_save_cost(
    gaps: list[float], interval: float, c: float, u: float, factor: float
) -> None:
    distinct = [float(sum(gaps[:k])) for k in range(len(gaps) + 1)]
    bounds = Bounds(60.0, 6 * 3600.0)
    first = restart_interval(distinct, interval, c, u, bounds)
    assert bounds.min_interval <= first <= interval
    repeats = quick_repeats(distinct, interval)
    assert first == interval or first == pytest.approx(max(60.0, sum(repeats) / len(repeats)))
    assert restart_interval(distinct, interval, c * factor, u, bounds) >= first
    assert restart_interval(distinct, interval, c, u * factor, bounds) >= first


def test_with_much_history_the_mtbf_is_the_observed_rate() -> None:
    assert estimate_mtbf(1000 * 3600.0, 1000, 24 * 3600.0) == pytest.approx(3600.0, rel=0.02)


def _history(n_interruptions: int, observed: float) -> History:
    saves = tuple(
        SaveRecord(f"checkpoint-{k}", 600.0 * k, 20.0, 90.0, "trainer") for k in range(10)
    )
    interruptions = tuple(
        Interruption(5000.0 * k + 1, "notice", "aws") for k in range(n_interruptions)
    )
    return History("run", observed, saves, interruptions)


def test_advice_from_history_and_the_cost_of_the_current_cadence() -> None:
    advice = advise(_history(10, 36_000.0), CadencePolicy())
    assert advice.basis == {"save": "trainer", "mtbf": "measured"}
    assert advice.save_seconds == 20.0 and advice.upload_seconds == 90.0
    assert advice.mtbf_seconds == pytest.approx((36_000 + 0.5 * 86400) / 10.5)
    assert advice.interval_seconds == pytest.approx(daly_interval(20.0, advice.mtbf_seconds))
    assert advice.current is not None
    assert advice.current.interval_seconds == pytest.approx(580.0)  # 600 s apart, 20 s saving
    assert advice.advised.total_fraction <= advice.current.total_fraction
    doc = advice.to_json()
    assert set(doc) >= {"interval_seconds", "save_seconds", "mtbf_seconds", "basis"}


def test_config_mtbf_overrides_the_learned_one_and_no_history_is_the_prior() -> None:
    assert (
        advise(_history(10, 36_000.0), CadencePolicy(mtbf_override=7200.0)).basis["mtbf"]
        == "config"
    )
    empty = advise(History("run"), CadencePolicy(prior_mtbf=3600.0))
    assert empty.basis == {"save": "none", "mtbf": "prior"}
    assert empty.mtbf_seconds == 3600.0
    assert empty.interval_seconds == Bounds().min_interval
    assert empty.current is None


def test_emergency_saves_do_not_set_the_routine_cost_or_cadence() -> None:
    saves = [SaveRecord(f"c-{k}", 100.0 * k, 5.0, 1.0) for k in range(4)]
    saves.append(SaveRecord("preempt", 350.0, 50.0, 30.0, emergency=True))
    assert current_interval(saves, 5.0) == 95.0
    assert advise(History("run", saves=tuple(saves)), CadencePolicy()).save_seconds == 5.0


# -- the history under the run ---------------------------------------------------------------


def test_history_round_trips_and_garbage_is_an_empty_history() -> None:
    history = _history(3, 100.0)
    assert parse_history(history.to_bytes(), "run") == history
    for junk in (b"", b"{", b"[]", b'{"format": "other"}', b"\xff" * 10):
        assert parse_history(junk, "run") == History("run")
    doc = json.loads(history.to_bytes())
    doc["saves"][0]["save_seconds"] = -1
    doc["interruptions"].append({"at": "yesterday", "kind": "notice"})
    parsed = parse_history(json.dumps(doc).encode(), "run")
    assert len(parsed.saves) == 9 and len(parsed.interruptions) == 3


def test_merge_adds_each_record_once_and_adds_observed_time() -> None:
    stored = _history(2, 100.0)
    again = merge_history(stored, saves=stored.saves[:2], interruptions=stored.interruptions)
    assert again.saves == stored.saves and again.interruptions == stored.interruptions
    more = merge_history(stored, interruptions=[Interruption(1.0, "restart")], observed_seconds=5)
    assert len(more.interruptions) == 3 and more.observed_seconds == 105.0


# -- what the trainer reports and reads --------------------------------------------------------


def test_the_trainers_save_report_is_found_by_name_then_by_step(tmp_path: Path) -> None:
    cadence = AdvisedCadence(tmp_path)
    cadence.report(1.5, checkpoint="checkpoint-10", step=10)
    cadence.report(2.5, step=20)
    assert reported_save_seconds(tmp_path, "checkpoint-10") == 1.5
    assert reported_save_seconds(tmp_path, "global_step20") == 2.5
    assert reported_save_seconds(tmp_path, "checkpoint-30") is None
    assert reported_save_seconds(tmp_path / "nowhere", "checkpoint-10") is None


def test_due_follows_the_advice_file_as_it_changes_and_never_during_a_save(tmp_path: Path) -> None:
    now = [0.0]
    cadence = AdvisedCadence(tmp_path, refresh_seconds=0.0, clock=lambda: now[0])
    assert cadence.interval() is None and not cadence.due()  # no advice: never due
    advice = tmp_path / ".ckptd" / "advice.json"
    advice.parent.mkdir()
    advice.write_text(json.dumps({"interval_seconds": 10.0}))
    now[0] = 9.0
    assert not cadence.due()
    now[0] = 10.0
    assert cadence.due()
    cadence.started()
    now[0] = 100.0
    assert not cadence.due()  # the previous save is still being written
    assert cadence.finished("checkpoint-1", 1) == pytest.approx(90.0)
    advice.write_text(json.dumps({"interval_seconds": 3.0, "pad": "x"}))  # a new size: re-read
    now[0] = 103.0
    assert cadence.interval() == 3.0 and cadence.due()
    assert reported_save_seconds(tmp_path, "checkpoint-1") == pytest.approx(90.0)


def test_the_first_save_follows_the_restart_interval_and_the_later_ones_the_interval(
    tmp_path: Path,
) -> None:
    now = [0.0]
    cadence = AdvisedCadence(tmp_path, refresh_seconds=0.0, clock=lambda: now[0])
    advice = tmp_path / ".ckptd" / "advice.json"
    advice.parent.mkdir()
    advice.write_text(json.dumps({"interval_seconds": 100.0, "restart_interval_seconds": 20.0}))
    now[0] = 19.0
    assert not cadence.due()
    now[0] = 20.0
    assert cadence.restart_interval() == 20.0 and cadence.due()
    with cadence.saving("checkpoint-1"):
        now[0] = 21.0
    now[0] = 41.0
    assert not cadence.due()  # the restart interval is spent: the interval counts now
    now[0] = 121.0
    assert cadence.due()
    # A restart interval longer than the interval (an old or odd advice) never delays a save.
    later = AdvisedCadence(tmp_path, refresh_seconds=0.0, clock=lambda: now[0])
    advice.write_text(json.dumps({"interval_seconds": 10.0, "restart_interval_seconds": 50.0}))
    now[0] += 10.0
    assert later.due()


def test_advice_parsing_and_the_url() -> None:
    assert advice_url("http://127.0.0.1:9464/v1/preemption") == "http://127.0.0.1:9464/v1/advice"
    assert advice_url("http://h:1") == "http://h:1/v1/advice"
    two = json.dumps({"runs": {"a": {"interval_seconds": 5}, "b": {"interval_seconds": 7}}})
    assert parse_advice(two, "b") == 7.0
    assert parse_advice(two) is None  # which run? the caller must say
    assert parse_advice(json.dumps({"runs": {"a": {"interval_seconds": 5}}})) == 5.0
    both = json.dumps({"interval_seconds": 50, "restart_interval_seconds": 20})
    assert parse_advice(both, key="restart_interval_seconds") == 20.0
    assert (
        parse_advice(json.dumps({"interval_seconds": 50}), key="restart_interval_seconds") is None
    )
    for junk in ("", "[]", '{"interval_seconds": -1}', '{"interval_seconds": true}'):
        assert parse_advice(junk) is None
