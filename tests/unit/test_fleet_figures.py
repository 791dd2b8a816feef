"""The fleet campaign's figures (``bench/_fleet_figures.py``) on hand-built logs whose
answers are known: goodput, steps lost per interruption by kind, replacement to first
step, resume success, bit-identity, the lanes, and logs cut short by a kill."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench._fleet_figures import (
    ClusterEvent,
    PolicyLog,
    Segment,
    attempt_from_records,
    campaign_figures,
    load_campaign,
    load_policy_log,
    parse_records,
    policy_figures,
)


def write(path: Path, records: list[dict[str, Any]], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def start(t: float, node: int, attempt: int, resumed: int) -> dict[str, Any]:
    return {"kind": "start", "t": t, "node": node, "attempt": attempt, "resumed_from": resumed}


def steps(first: int, last: int, t0: float) -> list[dict[str, Any]]:
    """Steps first..last, one a second, the first at t0."""
    return [{"kind": "step", "t": t0 + i, "step": s} for i, s in enumerate(range(first, last + 1))]


def end(t: float, step: int, digest: str = "aa") -> dict[str, Any]:
    return {"kind": "end", "t": t, "step": step, "digest": digest}


def uninterrupted(root: Path) -> None:
    # Steps 1..10 at 1000..1009, ended at 1009.5: 9 steps in 9.5 s.
    for node in (0, 1):
        write(
            root / "uninterrupted" / f"node{node}-a1.jsonl",
            [start(999, node, 1, 0), *steps(1, 10, 1000), end(1009.5, 10)],
        )


def ckptd_run(root: Path, *, digest: str = "aa") -> None:
    """A notice on node 0 (lost nothing), then a kill of node 1 at step 7 (resumed at 5)."""
    d = root / "ckptd"
    save4 = {"kind": "save", "t": 2003.4, "step": 4, "seconds": 0.3}
    write(d / "node0-a1.jsonl", [start(1999, 0, 1, 0), *steps(1, 4, 2000), save4])
    # node 1 killed mid-write: its last line is cut short.
    write(
        d / "node1-a1.jsonl",
        [start(1999, 1, 1, 0), *steps(1, 4, 2000)],
        tail='{"kind": "step", "t": 20',
    )
    write(d / "node1-a2.jsonl", [start(2004.5, 1, 2, 4), *steps(5, 7, 2008)])
    write(d / "node0-a2.jsonl", [start(2006.5, 0, 2, 4), *steps(5, 7, 2008)])
    write(d / "node0-a3.jsonl", [start(2010.5, 0, 3, 5), *steps(6, 10, 2014), end(2018.5, 10)])
    write(
        d / "node1-a3.jsonl",
        [start(2012.3, 1, 3, 5), *steps(6, 10, 2014), end(2018.5, 10, digest)],
    )
    write(
        d / "events.jsonl",
        [
            {"kind": "notice", "t": 2003.5, "nodes": [0], "provider": "aws"},
            {"kind": "gone", "t": 2004.0, "nodes": [0], "provider": "aws"},
            {"kind": "replaced", "t": 2006.0, "nodes": [0]},
            {"kind": "gone", "t": 2010.2, "nodes": [1], "provider": None},
            {"kind": "replaced", "t": 2012.0, "nodes": [1]},
        ],
    )
    write(
        d / "commits.jsonl",
        [
            {"kind": "commit", "t": 2001.5, "step": 2},
            {"kind": "commit", "t": 2003.8, "step": 4},
            {"kind": "commit", "t": 2009.0, "step": 5},
        ],
    )


@pytest.fixture
def campaign(tmp_path: Path) -> Path:
    uninterrupted(tmp_path)
    ckptd_run(tmp_path)
    return tmp_path


def test_goodput_is_steps_per_second_after_the_first_step_against_the_uninterrupted(
    campaign: Path,
) -> None:
    figures = campaign_figures(load_campaign(campaign))
    assert list(figures) == ["uninterrupted", "ckptd"]
    ref, run = figures["uninterrupted"], figures["ckptd"]
    assert ref.goodput == 1.0 and ref.wall == pytest.approx(9.5)
    assert ref.steps_per_second == pytest.approx(9 / 9.5)
    assert run.finished and run.steps == 10 and run.wall == pytest.approx(18.5)
    assert run.goodput == pytest.approx(9.5 / 18.5)
    assert run.origin == 2000 and run.attempts == 6


def test_goodput_less_the_replacement_wait_takes_out_the_time_no_host_existed(
    campaign: Path,
) -> None:
    figures = campaign_figures(load_campaign(campaign))
    ref, run = figures["uninterrupted"], figures["ckptd"]
    assert ref.replacement_wait == 0.0 and ref.goodput_less_wait == pytest.approx(1.0)
    # gone 2004.0 -> replaced 2006.0, gone 2010.2 -> replaced 2012.0
    assert run.replacement_wait == pytest.approx(3.8)
    assert run.goodput_less_wait == pytest.approx(9.5 / (18.5 - 3.8))


def test_overlapping_replacement_waits_count_once() -> None:
    from bench._fleet_figures import Interruption, replacement_wait

    def gone(at: float, replaced: float | None) -> Interruption:
        return Interruption("kill", None, (0,), None, at, replaced, 0, 0, 0, 0, None, True)

    spans = [gone(10, 14), gone(12, 13), gone(13, 16), gone(20, None), gone(30, 31)]
    assert replacement_wait(spans) == pytest.approx(6 + 1)


def test_steps_lost_by_kind_resumed_step_and_replacement_to_first_step(campaign: Path) -> None:
    run = campaign_figures(load_campaign(campaign))["ckptd"]
    notice, kill = run.interruptions
    assert (notice.kind, notice.provider, notice.nodes) == ("notice", "aws", (0,))
    assert (notice.notice_at, notice.gone_at, notice.replaced_at) == (2003.5, 2004.0, 2006.0)
    assert (notice.highest_step, notice.resumed_from, notice.lost_steps) == (4, 4, 0)
    assert notice.replace_to_first_step == pytest.approx(2.0)  # 2006 -> step 5 at 2008
    assert (kill.kind, kill.provider, kill.notice_at) == ("kill", None, None)
    # Steps 6 and 7 were done before the kill and again after it.
    assert (kill.highest_step, kill.resumed_from, kill.lost_steps) == (7, 5, 2)
    assert kill.replace_to_first_step == pytest.approx(2.0)  # 2012 -> step 6 at 2014
    assert run.lost_steps_by_kind == {"notice": (0,), "kill": (2,), "reclaim": ()}
    assert run.replace_to_first_step == pytest.approx((2.0, 2.0))


def test_resume_succeeds_only_at_the_newest_commit_before_the_node_went(campaign: Path) -> None:
    logs = load_campaign(campaign)
    run = campaign_figures(logs)["ckptd"]
    assert [i.expected_step for i in run.interruptions] == [4, 5]
    assert run.resume_success_rate == 1.0
    # Step 6 committed before the kill, yet the job resumed at 5: that resume failed.
    later = campaign_figures(logs, {"ckptd": [(2003.8, 4), (2009.5, 6)]})["ckptd"]
    assert [i.succeeded for i in later.interruptions] == [True, False]
    assert later.resume_success_rate == 0.5


def test_with_no_commits_known_a_resume_succeeds_when_the_job_resumed_and_ended(
    campaign: Path,
) -> None:
    (campaign / "ckptd" / "commits.jsonl").unlink()
    run = campaign_figures(load_campaign(campaign))["ckptd"]
    assert [i.expected_step for i in run.interruptions] == [None, None]
    assert run.resume_success_rate == 1.0
    for f in (campaign / "ckptd").glob("node*-a3.jsonl"):
        f.write_text("\n".join(f.read_text().splitlines()[:-1]) + "\n")  # no end record
    unfinished = campaign_figures(load_campaign(campaign))["ckptd"]
    assert not unfinished.finished and unfinished.goodput is None
    assert unfinished.resume_success_rate == 0.0


def test_bit_identical_only_when_every_end_digest_is_the_uninterrupted_ones(
    tmp_path: Path,
) -> None:
    uninterrupted(tmp_path)
    ckptd_run(tmp_path)
    assert campaign_figures(load_campaign(tmp_path))["ckptd"].bit_identical is True
    ckptd_run(tmp_path, digest="bb")
    figures = campaign_figures(load_campaign(tmp_path))["ckptd"]
    assert figures.bit_identical is False and figures.digest is None


def test_a_truncated_last_line_is_skipped_and_counted_never_fatal(campaign: Path) -> None:
    log = load_policy_log(campaign / "ckptd")
    assert log.skipped_lines == 1
    node1 = next(a for a in log.attempts if (a.node, a.attempt) == (1, 1))
    assert [s for _, s in node1.steps] == [1, 2, 3, 4]
    records, skipped = parse_records(
        '{"kind":"step","t":1,"step":1}\n[1]\n{"t":"x","kind":"a"}\n{"ki'
    )
    assert (len(records), skipped) == (1, 3)
    (campaign / "ckptd" / "node0-a1.jsonl").write_bytes(b'{"kind":"start","t":1\xe2\x82')
    assert load_policy_log(campaign / "ckptd").skipped_lines == 2


def test_missing_logs_read_as_empty_and_give_no_figures(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    figures = policy_figures(load_policy_log(tmp_path / "empty"))
    assert figures.attempts == 0 and not figures.finished and figures.goodput is None
    assert figures.interruptions == () and figures.resume_success_rate is None


def test_a_pool_reclaim_is_one_interruption_even_when_written_node_by_node() -> None:
    attempts = [
        attempt_from_records(n, 1, [start(0, n, 1, 0), *steps(1, 6, 1)]) for n in range(3)
    ] + [
        attempt_from_records(n, 2, [start(20, n, 2, 6), *steps(7, 8, 30), end(31.5, 8)])
        for n in range(3)
    ]
    events = (
        ClusterEvent("notice", 6.2, (0, 2), "gcp"),
        ClusterEvent("gone", 9.0, (0,), "gcp"),
        ClusterEvent("gone", 9.1, (2,), "gcp"),
        ClusterEvent("replaced", 15.0, (0,), None),
        ClusterEvent("replaced", 17.0, (2,), None),
    )
    run = policy_figures(PolicyLog("ckptd", tuple(attempts), events))
    (reclaim,) = run.interruptions
    assert (reclaim.kind, reclaim.provider, reclaim.nodes) == ("reclaim", "gcp", (0, 2))
    assert (reclaim.replaced_at, reclaim.lost_steps) == (17.0, 0)
    assert reclaim.replace_to_first_step == pytest.approx(13.0)
    assert run.lost_steps_by_kind["reclaim"] == (0,)


def test_lanes_show_starting_stepping_lost_saving_and_down(campaign: Path) -> None:
    run = campaign_figures(load_campaign(campaign))["ckptd"]
    node0 = [s for s in run.segments if s.node == 0]
    assert node0[:2] == [Segment(0, "starting", -1.0, 0.0), Segment(0, "stepping", 0.0, 3.0)]
    states = [(s.state, round(s.start, 1), round(s.end, 1)) for s in node0]
    assert states == [
        ("starting", -1.0, 0.0),
        ("stepping", 0.0, 3.0),
        ("down", 3.4, 6.5),
        ("starting", 6.5, 8.0),
        ("lost", 8.0, 10.0),  # steps 6 and 7, done again after the kill
        ("down", 10.0, 10.5),
        ("starting", 10.5, 14.0),
        ("stepping", 14.0, 18.0),
        ("saving", 3.1, 3.4),
    ]
    marks = {(m.node, m.kind, round(m.at, 1), m.provider) for m in run.marks}
    assert marks == {
        (0, "notice", 3.5, "aws"),
        (0, "gone", 4.0, "aws"),
        (0, "replaced", 6.0, None),
        (1, "kill", 10.2, None),
        (1, "replaced", 12.0, None),
    }
