"""The shared restore's decisions (``ckptd.peers.sharing.board``): where each file is read
from, what a node claims, when another's claim is taken over, and the state document
the participants exchange."""

from __future__ import annotations

import pytest

from ckptd.peers.sharing.board import (
    GONE_AFTER_REFUSALS,
    SILENT_SECONDS,
    ShareBoard,
    fetch_order,
    parse_state,
    ranges_of,
)

A, B = "10.0.0.1:4000", "10.0.0.2:4000"


def board(sizes: list[int] | None = None, stall: float = 10.0) -> ShareBoard:
    return ShareBoard(sizes or [100] * 6, stall_seconds=stall)


def state(
    verified: list[int] | None = None, claims: dict[int, int] | None = None, done: bool = False
) -> dict[str, object]:
    return {
        "version": 1,
        "verified": ranges_of(verified or []),
        "claims": {str(k): v for k, v in (claims or {}).items()},
        "done": done,
    }


def test_a_file_verified_elsewhere_is_read_from_there_and_holders_share_the_readers() -> None:
    b = board()
    b.heard(A, state([0, 1, 2, 3]), now=0)
    b.heard(B, state([0, 1, 2, 3]), now=0)
    picks = {b.source(n, now=0) for n in range(4)}
    assert picks == {("peer", A), ("peer", B)}
    assert b.claims == {}  # nothing claimed: nothing from the store


def test_an_unclaimed_file_is_claimed_and_fetched_from_the_store() -> None:
    b = board()
    b.heard(A, state(), now=0)
    assert b.source(0, now=0) == ("store", "")
    assert 0 in b.claims
    assert b.document()["claims"] == {"0": 0}
    assert b.source(0, now=1) == ("store", "")  # its next range too


def test_a_file_another_node_fetches_waits_while_it_moves_and_is_taken_over_once_it_stalls() -> (
    None
):
    b = board(stall=10)
    b.heard(A, state(claims={2: 0}), now=0)
    assert b.source(2, now=1) == ("wait", "")
    b.heard(A, state(claims={2: 50}), now=8)  # it moved at 8
    b.heard(A, state(claims={2: 50}), now=14)  # answering, not moving
    assert b.source(2, now=17) == ("wait", "")
    b.heard(A, state(claims={2: 50}), now=19)  # no byte since 8
    assert b.source(2, now=19) == ("store", "")


def test_a_participant_whose_port_refuses_is_gone_and_its_claims_are_void() -> None:
    b = board()
    b.heard(A, state([1], claims={2: 10}), now=0)
    for _ in range(GONE_AFTER_REFUSALS):
        b.unanswered(A, now=1, refused=True)
    assert not b.live(A, now=1)
    assert b.source(1, now=1) == ("store", "")  # what it verified is not read from it
    assert b.source(2, now=1) == ("store", "")


def test_a_slow_answer_is_no_death_but_silence_is() -> None:
    b = board()
    b.heard(A, state(claims={2: 10}), now=0)
    b.unanswered(A, now=3, refused=False)  # a held poll answered late on a busy node
    assert b.live(A, now=3)
    assert b.source(2, now=3) == ("wait", "")
    assert not b.live(A, now=SILENT_SECONDS + 0.1)
    assert b.source(2, now=SILENT_SECONDS + 0.1) == ("store", "")


def test_one_that_served_bad_bytes_is_never_read_from_again() -> None:
    b = board()
    b.heard(A, state([0, 1]), now=0)
    b.served_badly(A)
    b.heard(A, state([0, 1]), now=1)  # it still answers polls
    assert b.source(0, now=1) == ("store", "")


def test_a_node_alone_claims_at_once_and_one_beside_others_only_once_it_heard_them() -> None:
    alone = board([100] * 6)
    assert [alone.source(n, now=0) for n in range(6)] == [("store", "")] * 6
    b = board([100] * 6)
    b.join(A, now=0)  # its record listed: not heard yet
    assert b.source(0, now=0) == ("wait", "")
    b.heard(A, state(claims={0: 0}), now=0.01)
    assert b.source(0, now=0.01) == ("wait", "")  # A fetches it: wait for A
    assert b.source(3, now=0.01) == ("store", "")
    # One that never answers holds nothing back once it is gone.
    c = board([100] * 6)
    c.join(A, now=0)
    assert c.source(0, now=1) == ("wait", "")
    assert c.source(0, now=SILENT_SECONDS + 0.1) == ("store", "")


def test_once_the_others_are_met_claims_in_flight_are_held_to_the_share() -> None:
    b = board([100] * 6)
    b.heard(A, state(), now=0)
    b.heard(B, state(), now=0)
    assert b.source(0, now=1) == ("store", "")
    assert b.source(1, now=1) == ("store", "")
    assert b.source(2, now=1) == ("wait", "")  # 200 of 600 bytes in flight: a third
    b.kept(0)
    assert b.source(2, now=1) == ("store", "")


def test_a_file_larger_than_the_share_is_still_claimed_when_nothing_else_is() -> None:
    b = board([1000, 10, 10])
    b.expected, b.expect_until = 4, 5.0
    assert b.source(0, now=0) == ("store", "")


def test_others_busy_holds_a_finished_node_only_for_live_ones_that_move() -> None:
    b = board()
    b.heard(A, state([0]), now=0)
    b.heard(B, state([0], done=True), now=0)
    assert b.others_busy(now=1, idle_seconds=30)
    b.heard(A, state([0], done=True), now=2)
    assert not b.others_busy(now=2, idle_seconds=30)
    c = board()
    c.heard(A, state([0]), now=0)
    c.heard(A, state([0]), now=40)  # answering, but stuck for 40 s
    assert not c.others_busy(now=40, idle_seconds=30)


def test_the_version_grows_with_each_change_a_poll_waits_for() -> None:
    b = board()
    seen = b.version
    b.source(0, now=0)
    assert b.version > seen
    seen = b.version
    b.fetched(0, 50)  # progress alone wakes no poll
    assert b.version == seen
    b.kept(0)
    assert b.version > seen
    seen = b.version
    b.finished()
    assert b.version > seen and b.document()["done"] is True


def test_ranges_round_trip_through_the_document() -> None:
    numbers = [0, 1, 2, 5, 7, 8, 40]
    assert ranges_of(numbers) == [[0, 2], [5, 5], [7, 8], [40, 40]]
    verified, claims, done = parse_state(state(numbers, {3: 7}), files=41)
    assert verified == frozenset(numbers) and claims == {3: 7} and not done


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"verified": [[0, 9]]},  # beyond the manifest's files
        {"verified": [[3, 1]]},
        {"verified": [["0", "1"]]},
        {"claims": {"2": -1}},
        {"claims": {"99": 1}},
        {"claims": []},
        {"done": "yes"},
    ],
)
def test_a_state_that_is_not_one_is_refused(doc: object) -> None:
    with pytest.raises(ValueError):
        parse_state(doc, files=5)


# -- the order a node fetches in ------------------------------------------------------------


def test_each_node_fetches_its_own_stretch_first_then_the_rest_from_the_far_end() -> None:
    sizes = [100] * 10
    assert fetch_order(sizes, 0, 2) == [0, 1, 2, 3, 4, 9, 8, 7, 6, 5]
    assert fetch_order(sizes, 1, 2) == [5, 6, 7, 8, 9, 4, 3, 2, 1, 0]
    # Three nodes: every stretch is stolen first from its end, each by one node.
    orders = [fetch_order(sizes, p, 3) for p in range(3)]
    assert orders == [
        [0, 1, 2, 9, 8, 7, 6, 5, 4, 3],
        [3, 4, 5, 2, 1, 0, 9, 8, 7, 6],
        [6, 7, 8, 9, 5, 4, 3, 2, 1, 0],
    ]
    assert all(sorted(o) == list(range(10)) for o in orders)


def test_the_stretches_follow_the_bytes_not_the_count_of_files() -> None:
    # 2,000 bytes: place 1 of 2 begins at byte 1,000, inside the big file (number 3).
    sizes = [1, 1, 1, 1000, 1, 1, 990, 1, 0, 5]
    assert fetch_order(sizes, 0, 2) == [0, 1, 2, 9, 8, 7, 6, 5, 4, 3]
    assert fetch_order(sizes, 1, 2) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    # Place 1 of 3 begins at byte 666 (file 3), place 2 at 1,333 (file 6).
    assert fetch_order(sizes, 1, 3)[:3] == [3, 4, 5]
    assert fetch_order(sizes, 2, 3)[:4] == [6, 7, 8, 9]
    for out_of in range(1, 6):
        for place in range(out_of):
            assert sorted(fetch_order(sizes, place, out_of)) == list(range(len(sizes)))
        assert fetch_order([], 0, out_of) == []
    assert fetch_order(sizes, 0, 1) == list(range(len(sizes)))
