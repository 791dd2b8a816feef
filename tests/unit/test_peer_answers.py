"""``PeerAnswers``: the routes of a restore from peers, filled in as the peers answer
(``ckptd.peers.source``, module doc, 3). No network: answers are handed in directly."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ckptd.core.manifest import ManifestFile, build_manifest
from ckptd.peers import source
from ckptd.peers.model import Holding
from ckptd.peers.source import PeerAnswers

FILES = [("a", 10, "0000000a"), ("b", 20, "0000000b")]


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def manifest() -> Any:
    return build_manifest(
        run_id="run",
        checkpoint="step-10",
        step=10,
        layout="dcp",
        host="h",
        created_at=0.0,
        committed_at=1.0,
        files=FILES,
        environment={},
    )


def holding(*paths: str) -> Holding:
    return Holding(
        id="h1",
        kind="replica",
        run_id="run",
        checkpoint="step-10",
        name="step-10",
        save="s",
        node_rank=1,
        files=[ManifestFile(path=p, size=s, crc32c=c) for p, s, c in FILES if p in paths],
    )


KEYS = {"a": "run/step-10/a", "b": "run/step-10/b"}


def test_an_answer_before_the_manifest_is_routed_once_it_is_read() -> None:
    answers = PeerAnswers(["p:1", "q:1"], _Log(), wait_seconds=10, grace=30)
    answers.answer("p:1", [holding("a")])
    answers.no_answer("q:1", "refused")
    answers.expect(manifest(), KEYS)
    assert answers.settled()
    assert answers.routes_for("run/step-10/a") == [("p:1", "h1", 0)]
    assert answers.routes_for("run/step-10/b") == []  # nobody pending: no wait (grace 30 s)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_after_the_grace_the_store_then_a_late_answer_routes_the_rest() -> None:
    clock = Clock()
    answers = PeerAnswers(["p:1"], _Log(), wait_seconds=10, grace=0.5, clock=clock)
    answers.expect(manifest(), KEYS)
    clock.now += 0.5  # the grace is over, the peer still to answer
    assert answers.routes_for("run/step-10/b") == [] and not answers.settled()
    # A late answer (within the wait) still routes the ranges asked for after it.
    clock.now += 2
    answers.answer("p:1", [holding("a", "b")])
    assert answers.routes_for("run/step-10/b") == [("p:1", "h1", 1)]


def test_a_waiting_range_goes_to_the_peer_that_answers_within_the_grace() -> None:
    answers = PeerAnswers(["p:1"], _Log(), wait_seconds=10, grace=30)
    answers.expect(manifest(), KEYS)
    found: list[Any] = []
    reader = threading.Thread(target=lambda: found.append(answers.routes_for("run/step-10/a")))
    reader.start()
    answers.answer("p:1", [holding("a")])
    reader.join(timeout=10)
    assert found == [[("p:1", "h1", 0)]]


def test_an_answer_later_than_the_wait_is_not_used() -> None:
    clock = Clock()
    answers = PeerAnswers(["p:1"], _Log(), wait_seconds=10, grace=0.5, clock=clock)
    answers.expect(manifest(), KEYS)
    clock.now += 10.5
    answers.answer("p:1", [holding("a")])
    assert answers.settled() and answers.routes_for("run/step-10/a") == []


def test_every_peer_is_asked_by_at_most_asking_threads_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(source, "ASKING_THREADS", 2)
    addresses = [f"p{i}:1" for i in range(7)]
    answers = PeerAnswers(addresses, _Log(), wait_seconds=10, grace=30)
    answers.expect(manifest(), KEYS)
    lock = threading.Lock()
    busy, most = [0], [0]

    class Reader:
        def holdings(self, address: str, run: str, timeout: float) -> list[Holding]:
            with lock:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            try:
                if address == "p3:1":
                    raise source.PeerReadError("refused")
                return [holding("a")]
            finally:
                with lock:
                    busy[0] -= 1

    source.ask_peers(Reader(), "run", answers)  # type: ignore[arg-type]
    with answers._cond:  # woken by each answer: no sleep
        assert answers._cond.wait_for(lambda: not answers._pending, timeout=10)
    assert sorted(answers.answered) == [a for a in addresses if a != "p3:1"]
    assert answers.routes_for("run/step-10/a") == [(a, "h1", 0) for a in answers.answered]
    assert most[0] <= 2
