"""The other runs on the same store count toward a run's interruption rate
(``ckptd.cadence.model.OtherRuns``, ``[cadence] learn_from_other_runs``): pure, and through a
daemon that reads a sibling run's ``<run>/CADENCE`` at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptd.cadence.history import write_history
from ckptd.cadence.model import (
    NO_OTHER_RUNS,
    CadencePolicy,
    History,
    Interruption,
    OtherRuns,
    SaveRecord,
    advise,
    costly_interruptions,
    distinct_interruptions,
    estimate_mtbf,
)
from ckptd.repository import Repository
from ckptd.storage.fs import FileStorage
from tests.support.daemon import Daemon, wait_until

HOUR = 3600.0


def _run(name: str, observed_hours: float, at_hours: list[float]) -> History:
    interruptions = tuple(Interruption(h * HOUR, "notice", "aws") for h in at_hours)
    return History(name, observed_hours * HOUR, interruptions=interruptions)


times = st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=30)


@given(runs=st.lists(times, max_size=6), interval=st.floats(min_value=0, max_value=1e5))
def test_other_runs_costly_count_is_the_sum_of_each_runs(
    runs: list[list[float]], interval: float
) -> None:
    histories = [
        History(f"r{k}", 1.0, interruptions=tuple(Interruption(t, "notice") for t in ts))
        for k, ts in enumerate(runs)
    ]
    others = OtherRuns.of(histories, merge_seconds=60.0)
    expected = sum(costly_interruptions(distinct_interruptions(ts, 60.0), interval) for ts in runs)
    assert others.costly(interval) == expected
    assert others.observed_seconds == len(runs)


def test_a_new_run_starts_from_the_fleets_rate_not_the_prior() -> None:
    fleet = [_run("a", 400, [100, 300]), _run("b", 400, [50, 150, 390]), _run("c", 400, [])]
    others = OtherRuns.of(fleet)
    fresh = advise(History("new"), CadencePolicy(), others)
    assert fresh.basis["mtbf"] == "other runs"
    # (observed + others' + ½·24 h) / (count + others' + ½), the runs 50 h+ apart.
    assert fresh.mtbf_seconds == pytest.approx(estimate_mtbf(1200 * HOUR, 5))
    assert advise(History("new"), CadencePolicy()).basis["mtbf"] == "prior"
    # The run's own history joins the others'; an override still wins.
    own = advise(_run("new", 100, [10, 60]), CadencePolicy(), others)
    assert own.basis["mtbf"] == "measured"
    assert own.mtbf_seconds == pytest.approx(estimate_mtbf(1300 * HOUR, 7))
    assert advise(History("new"), CadencePolicy(mtbf_override=7.0), others).mtbf_seconds == 7.0
    assert advise(History("new"), CadencePolicy(), NO_OTHER_RUNS) == advise(
        History("new"), CadencePolicy()
    )


def test_the_next_blows_of_another_runs_burst_do_not_count() -> None:
    """As for the run's own (``costly_interruptions``): a blow minutes after the one
    before says nothing about how often to save."""
    saves = tuple(SaveRecord(f"checkpoint-{k}", 600.0 * k, 60.0, 60.0) for k in range(4))
    new = History("new", saves=saves)  # saves of a minute: an interval of hours
    burst = OtherRuns.of([_run("a", 1000, [500, 500.3, 500.6, 500.9])], merge_seconds=60.0)
    single = OtherRuns.of([_run("a", 1000, [500])], merge_seconds=60.0)
    with_burst = advise(new, CadencePolicy(), burst)
    assert with_burst.interval_seconds > 0.3 * HOUR
    assert with_burst.mtbf_seconds == pytest.approx(
        advise(new, CadencePolicy(), single).mtbf_seconds
    )
    # Spread out, the same four blows are four interruptions.
    spread = OtherRuns.of([_run("a", 1000, [100, 300, 500, 700])], merge_seconds=60.0)
    assert advise(new, CadencePolicy(), spread).mtbf_seconds < with_burst.mtbf_seconds


@pytest.mark.parametrize("learn", [True, False], ids=["default", "off"])
def test_the_daemon_learns_from_the_other_runs_in_its_store(tmp_path: Path, learn: bool) -> None:
    store = tmp_path / "store"
    write_history(Repository(FileStorage(store)), _run("yesterday", 200, [20, 80, 150, 190]))
    watch = tmp_path / "watch"
    watch.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": watch, "run_id": "today"}],
        dest=f"file://{store}",
        state_dir=tmp_path / "state",
    )
    if not learn:
        daemon.env["CKPTD_CADENCE__LEARN_FROM_OTHER_RUNS"] = "false"
    with daemon:
        # The store's histories are read beside the start-up (never holding READY).
        advice = wait_until(
            lambda: (
                (a := daemon.get_json("/v1/advice")["runs"].get("today"))
                and a["history"] == "read"
                and a
            ),
            30,
            "advice from the store's history",
        )
    assert advice["basis"]["mtbf"] == ("other runs" if learn else "prior")
    expected = estimate_mtbf(200 * HOUR, 4) if learn else 24 * HOUR
    assert advice["mtbf_seconds"] == pytest.approx(expected, rel=1e-3)
