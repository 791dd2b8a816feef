"""The pure rules that keep a part off nodes about to go: placement never picks a node
under notice (its announcement says so, or the run's NOTICE names it), and a push's
watch gives a holder up exactly when it stopped answering, took nothing, or has a notice
(``ckptd.peers.placement``, ``ckptd.peers.liveness``)."""

from __future__ import annotations

import pytest

from ckptd.peers.liveness import (
    REPLACED_WITHIN_SECONDS,
    STALL_SECONDS,
    UNBOUNDED_NOTICE_SECONDS,
    Liveness,
)
from ckptd.peers.model import PeerAnnouncement
from ckptd.peers.placement import NoticeMark, candidates, notice_mark, under_notice

NOW = 1_800_000_000.0


def announcement(rank: int, *, nodes: int = 4, **extra: object) -> PeerAnnouncement:
    doc = {
        "run_id": "run",
        "node_rank": rank,
        "nodes": nodes,
        "peer": f"peer-{rank}",
        "incarnation": "i",
        "host": f"node-{rank}",
        "address": f"10.0.0.{rank + 1}:9465",
        "quota_bytes": 100,
        "free_bytes": 100,
        "updated_at": NOW,
        "started_at": NOW - 600,
        **extra,
    }
    return PeerAnnouncement.model_validate(doc)


def place(
    rank: int, found: list[PeerAnnouncement], notices: dict[int, NoticeMark] | None = None
) -> list[int]:
    chosen = candidates(
        found,
        rank=rank,
        peer=f"peer-{rank}",
        failure_domain="",
        part_bytes=10,
        now=NOW,
        stale_after=90,
        notices=notices,
    )
    return [a.node_rank for a in chosen]


def mark(rank: int, *, noticed: float = NOW - 2, until: float = NOW + 28) -> NoticeMark:
    return NoticeMark(rank, noticed, until)


# -- placement -----------------------------------------------------------------------------


def test_the_issue_case_node_2s_part_goes_to_node_1_not_to_node_0_under_notice() -> None:
    # Three nodes, copies = 1, node 0 noticed: the ring puts node 2's part on node 0
    # first (2 + 1 mod 3); with node 0 under notice it goes to node 1.
    nodes = [announcement(r, nodes=3) for r in range(3)]
    assert place(2, nodes) == [0, 1]
    assert place(2, nodes, {0: mark(0)}) == [1]
    noticed = [announcement(0, nodes=3, notice_until=NOW + 25), *nodes[1:]]
    assert place(2, noticed) == [1]


def test_two_of_four_noticed_at_once_each_survivor_places_on_the_other() -> None:
    # NOTICE names only one of them (one object, the last writer's); the other's own
    # announcement says it. No part of anyone goes to either.
    nodes = [
        announcement(0, notice_until=NOW + 30),
        announcement(1, notice_until=NOW + 30),
        announcement(2),
        announcement(3),
    ]
    marks = {1: mark(1)}
    assert {r: place(r, nodes, marks) for r in range(4)} == {0: [2, 3], 1: [2, 3], 2: [3], 3: [2]}


def test_a_notice_ends_at_its_deadline() -> None:
    nodes = [announcement(r) for r in range(3)]
    assert place(2, nodes, {0: mark(0, until=NOW - 0.1)}) == [0, 1]
    expired = [announcement(0, notice_until=NOW - 0.1), *nodes[1:]]
    assert place(2, expired) == [0, 1]


def test_a_replacement_started_after_the_notice_at_the_same_rank_is_not_under_it() -> None:
    replacement = announcement(0, started_at=NOW - 1, address="10.0.0.9:9465")
    zombie = announcement(0, started_at=NOW - 600, updated_at=NOW - 5)
    marks = {0: mark(0, noticed=NOW - 10)}
    assert under_notice(replacement, marks, NOW) is False
    assert under_notice(zombie, marks, NOW) is True
    # The newest announcement of the rank decides: the replacement is a candidate.
    assert place(1, [zombie, replacement, announcement(2)], marks) == [2, 0]
    # One that does not say when it started (an older daemon) counts as noticed.
    unknown = announcement(0, started_at=None)
    assert under_notice(unknown, marks, NOW) is True


def test_a_notice_document_marks_its_node_until_its_deadline() -> None:
    found = notice_mark(
        {
            "node_rank": 2,
            "noticed_at": "2027-01-15T08:00:00.000Z",
            "deadline": "2027-01-15T08:00:30.000Z",
        }
    )
    assert found is not None
    assert found.rank == 2 and found.until - found.noticed_at == 30.0


def test_a_notice_without_a_deadline_marks_its_node_for_the_unbounded_time() -> None:
    found = notice_mark({"node_rank": 1, "noticed_at": "2027-01-15T08:00:00Z", "deadline": None})
    assert found is not None and found.until - found.noticed_at == UNBOUNDED_NOTICE_SECONDS


@pytest.mark.parametrize(
    "doc",
    [
        None,
        {},
        {"node_rank": "1", "noticed_at": "2027-01-15T08:00:00Z"},
        {"node_rank": True, "noticed_at": "2027-01-15T08:00:00Z"},
        {"node_rank": -1, "noticed_at": "2027-01-15T08:00:00Z"},
        {"node_rank": 1, "noticed_at": "yesterday"},
        {"node_rank": 1, "noticed_at": "2027-01-15T08:00:00"},  # no zone: not ours
    ],
)
def test_what_is_no_notice_of_a_node_marks_none(doc: dict[str, object] | None) -> None:
    assert notice_mark(doc) is None


# -- liveness ------------------------------------------------------------------------------


def test_a_holder_that_answers_nothing_is_given_up_after_the_stall_and_not_before() -> None:
    w = Liveness(started=100.0)
    assert w.stalled(100.0 + STALL_SECONDS) is None
    assert w.stalled(100.0 + STALL_SECONDS + 0.01) == "silent"
    w.heard(103.0)
    assert w.stalled(103.0 + STALL_SECONDS) is None
    assert w.stalled(103.0 + STALL_SECONDS + 0.01) == "silent"


def test_a_holder_that_answers_hellos_but_takes_no_chunk_in_flight_is_stalled() -> None:
    w = Liveness(started=0.0)
    w.chunk_sent(1.0)
    for t in (2.0, 3.0, 4.0, 5.0):
        w.heard(t)  # its hello answers
    assert w.stalled(5.0) is None
    assert w.stalled(5.1) == "stalled"
    w.chunk_ended(5.2, taken=True)
    assert w.stalled(5.3) is None


def test_time_waiting_on_the_pace_or_a_backoff_is_no_stall() -> None:
    w = Liveness(started=0.0)
    w.chunk_sent(0.5)
    w.chunk_ended(0.7, taken=True)
    # No chunk in flight for 20 s (a paced push), the holder answering its hellos.
    for t in range(1, 21):
        w.heard(float(t))
    assert w.stalled(20.5) is None
    w.chunk_sent(20.6)  # in flight again: the stall counts from here, not from 0.7
    for t in (21.0, 22.0, 23.0, 24.0):
        w.heard(t)
    assert w.stalled(20.6 + STALL_SECONDS - 0.1) is None
    assert w.stalled(20.6 + STALL_SECONDS + 0.1) == "stalled"


def test_a_notice_gives_the_holder_up_at_once_and_for_good() -> None:
    w = Liveness(started=0.0)
    w.heard(0.5, notice=True)
    assert w.stalled(0.5) == "notice"
    w.heard(0.6)
    assert w.stalled(0.6) == "notice"


def test_the_bound_is_well_inside_a_30_s_notice() -> None:
    assert REPLACED_WITHIN_SECONDS <= 5.0
