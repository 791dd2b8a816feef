"""The fleet campaign's trace (``bench/_fleet_trace.py``): the same seed gives the same
trace, and every trace keeps the invariant the cluster needs to survive it."""

from __future__ import annotations

import pytest

from bench._fleet_trace import (
    DEFAULT_MIX,
    WINDOWS,
    Event,
    Trace,
    leaves_a_node,
    make_trace,
    smoke_trace,
    violations,
)

SEEDS = range(200)


def test_the_same_seed_gives_the_same_json_and_another_seed_another() -> None:
    first = make_trace(7, scale=0.1, duration=900).to_json()
    assert make_trace(7, scale=0.1, duration=900).to_json() == first
    assert make_trace(8, scale=0.1, duration=900).to_json() != first
    assert make_trace(7, scale=0.1, duration=900, events=6).to_json() == (
        make_trace(7, scale=0.1, duration=900, events=6).to_json()
    )


def test_json_round_trips_to_the_same_trace_and_text() -> None:
    for seed in range(20):
        trace = make_trace(seed, 5, scale=0.2, duration=1200, events=5)
        again = Trace.from_json(trace.to_json())
        assert again == trace
        assert again.to_json() == trace.to_json()
        assert all(isinstance(e.nodes, tuple) for e in again.events)


@pytest.mark.parametrize("events", [None, 6])
def test_every_trace_keeps_the_invariant_over_many_seeds(events: int | None) -> None:
    for seed in SEEDS:
        trace = make_trace(seed, 4, scale=0.1, duration=900, events=events, min_gap=25.0)
        assert violations(trace, min_gap=25.0) == [], seed
        assert leaves_a_node(trace), seed
        assert trace.events, seed
        if events is not None:
            assert len(trace.events) == events


def test_the_default_mix_brings_every_kind_and_windows_are_the_clouds_scaled() -> None:
    seen: set[tuple[str, str | None]] = set()
    for seed in SEEDS:
        for e in make_trace(seed, 4, scale=0.1, duration=900).events:
            seen.add((e.category, e.provider))
            if e.kind == "notice":
                assert e.provider is not None
                assert e.window == pytest.approx(WINDOWS[e.provider] * 0.1)
                assert e.gone_at == pytest.approx(e.at + e.window)
            else:
                assert (e.window, e.provider, len(e.nodes)) == (0.0, None, 1)
                assert e.gone_at == e.at
            assert 6.0 - 1e-9 <= e.replace_after <= 18.0 + 1e-9  # 60-180 real s at 0.1
    categories = {c for c, _ in seen}
    assert categories == {"notice", "kill", "reclaim"}
    assert {p for c, p in seen if c == "notice"} == {"aws", "gcp", "azure"}
    assert set(DEFAULT_MIX) == {"aws", "gcp", "azure", "kill", "reclaim"}


def test_a_reclaim_takes_two_to_all_but_one_node_of_the_pool() -> None:
    sizes = {
        len(e.nodes)
        for seed in range(50)
        for e in make_trace(seed, 5, scale=0.1, duration=900, mix={"reclaim": 1.0}).events
    }
    assert sizes == {2, 3, 4}


def test_a_reclaim_needs_three_nodes_and_only_whole_leaves_none_standing() -> None:
    two = make_trace(1, 2, scale=0.1, duration=900, mix={"reclaim": 5.0, "kill": 1.0})
    assert {e.category for e in two.events} == {"kill"}
    with pytest.raises(ValueError, match="no kind"):
        make_trace(1, 2, scale=0.1, duration=900, mix={"reclaim": 1.0})
    whole = make_trace(1, 3, scale=0.1, duration=900, mix={"whole": 1.0})
    assert whole.events and all(e.nodes == (0, 1, 2) for e in whole.events)
    assert not leaves_a_node(whole)
    with pytest.raises(ValueError, match="unknown"):
        make_trace(1, 3, scale=0.1, duration=900, mix={"meteor": 1.0})


def test_too_many_events_for_the_duration_is_refused() -> None:
    with pytest.raises(ValueError, match="need"):
        make_trace(1, 4, scale=0.1, duration=100, events=10)


def test_violations_names_an_event_too_soon_and_a_kill_with_a_window() -> None:
    early = Trace(
        0,
        2,
        0.1,
        100.0,
        (
            Event(10.0, "notice", (0,), "gcp", 3.0, 5.0),
            Event(20.0, "kill", (1,), None, 2.0, 5.0),
        ),
    )
    found = violations(early, min_gap=5.0)
    assert any("event 1" in v and "before the cluster is whole" in v for v in found)
    assert any("kill with a provider, a window" in v for v in found)
    assert violations(Trace(0, 2, 0.1, 100.0, (Event(10.0, "notice", (2,), "aws", 12.0, 1.0),)))


def test_the_smoke_trace_is_two_nodes_a_notice_then_a_kill() -> None:
    for seed in range(30):
        trace = smoke_trace(seed)
        assert trace.nodes == 2
        assert [e.kind for e in trace.events] == ["notice", "kill"]
        assert violations(trace, min_gap=20.0) == []
        assert smoke_trace(seed) == trace
    assert len({smoke_trace(s).to_json() for s in range(30)}) == 30
