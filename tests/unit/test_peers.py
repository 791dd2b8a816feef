"""The pure rules of peer replication: which peers take a part, what a signature and an
acknowledgement prove, which holding may serve which file of a manifest."""

from __future__ import annotations

import json

import pytest

from ckptd.core.manifest import ManifestError, ManifestFile
from ckptd.peers import auth
from ckptd.peers.model import (
    Holding,
    PeerAnnouncement,
    Replica,
    chunk_spans,
    matches_offer,
    parse_offer,
    replica_id,
    routes,
)
from ckptd.peers.placement import candidates

TOKEN = b"0123456789abcdef0123456789abcdef"
NOW = 1_800_000_000.0


def announcement(
    rank: int, *, nodes: int = 4, domain: str = "", **extra: object
) -> PeerAnnouncement:
    doc = {
        "run_id": "run",
        "node_rank": rank,
        "nodes": nodes,
        "peer": f"peer-{rank}",
        "incarnation": "i",
        "host": f"node-{rank}",
        "address": f"10.0.0.{rank + 1}:9465",
        "failure_domain": domain,
        "quota_bytes": 100,
        "free_bytes": 100,
        "updated_at": NOW,
        **extra,
    }
    return PeerAnnouncement.model_validate(doc)


def place(
    rank: int, found: list[PeerAnnouncement], *, domain: str = "", need: int = 10
) -> list[int]:
    chosen = candidates(
        found,
        rank=rank,
        peer=f"peer-{rank}",
        failure_domain=domain,
        part_bytes=need,
        now=NOW,
        stale_after=90,
    )
    return [a.node_rank for a in chosen]


def test_a_part_never_goes_to_its_own_node_a_stale_peer_or_one_too_small() -> None:
    found = [
        announcement(0),
        announcement(1, updated_at=NOW - 91),  # its daemon stopped announcing
        announcement(2, quota_bytes=5),  # its whole quota cannot hold the part
        announcement(3),
    ]
    assert place(0, found) == [3]


def test_another_failure_domain_comes_first() -> None:
    found = [announcement(r, domain="zone-a" if r < 2 else "zone-b") for r in range(4)]
    assert place(0, found, domain="zone-a") == [2, 3, 1]


def test_a_peer_with_free_room_comes_before_one_that_must_evict() -> None:
    found = [announcement(1, free_bytes=0), announcement(2)]
    assert place(0, found) == [2, 1]


@pytest.mark.parametrize("nodes", [2, 3, 5, 7])
def test_any_node_count_spreads_the_parts_over_distinct_holders(nodes: int) -> None:
    found = [announcement(r, nodes=nodes) for r in range(nodes)]
    first = [place(r, found)[0] for r in range(nodes)]
    assert sorted(first) == list(range(nodes))  # every node holds exactly one part
    assert all(f != r for r, f in enumerate(first))


def test_a_replacement_with_a_new_address_wins_over_its_dead_predecessor() -> None:
    old = announcement(1, updated_at=NOW - 30)
    new = announcement(1, updated_at=NOW - 1, address="10.0.0.99:9465", peer="peer-1b")
    chosen = candidates(
        [old, new], rank=0, peer="peer-0", failure_domain="", part_bytes=1, now=NOW, stale_after=90
    )
    assert [a.address for a in chosen] == ["10.0.0.99:9465"]


# -- signatures ----------------------------------------------------------------------------


def test_a_signed_request_passes_once() -> None:
    header, nonce = auth.sign(
        TOKEN, "PUT", "/v1/peer/transfers/t/files/0/0", NOW, "crc32c:00ff00ff"
    )
    checker = auth.RequestChecker(TOKEN)
    assert checker.check(
        header, "PUT", "/v1/peer/transfers/t/files/0/0", NOW + 1, "crc32c:00ff00ff"
    ) == (None, nonce)
    why, _ = checker.check(
        header, "PUT", "/v1/peer/transfers/t/files/0/0", NOW + 1, "crc32c:00ff00ff"
    )
    assert why == "a replayed request"


@pytest.mark.parametrize(
    ("token", "method", "target", "now", "body", "why"),
    [
        (b"another-token-0123456789abcdef00", "GET", "/x", NOW, "", "wrong signature"),
        (TOKEN, "POST", "/x", NOW, "", "wrong signature"),  # another method
        (TOKEN, "GET", "/y", NOW, "", "wrong signature"),  # another target
        (TOKEN, "GET", "/x", NOW, "crc32c:00000000", "wrong signature"),  # another body
        (TOKEN, "GET", "/x", NOW + 301, "", "from this node's clock"),
    ],
)
def test_a_request_signed_otherwise_is_refused(
    token: bytes, method: str, target: str, now: float, body: str, why: str
) -> None:
    header, _ = auth.sign(token, "GET", "/x", NOW, "")
    refused, _ = auth.RequestChecker(TOKEN).check(header, method, target, now, body)
    assert refused is not None and why in refused


@pytest.mark.parametrize("header", [None, "", "Bearer " + TOKEN.decode(), "ckptd-peer 1:x:y"])
def test_no_signature_is_no_access(header: str | None) -> None:
    refused, _ = auth.RequestChecker(TOKEN).check(header, "GET", "/x", NOW)
    assert refused is not None


def test_an_acknowledgement_holds_only_for_its_request_and_replica() -> None:
    proof = auth.ack(TOKEN, "nonce-1", "replica-a")
    assert auth.ack_holds(TOKEN, "nonce-1", "replica-a", proof)
    assert not auth.ack_holds(TOKEN, "nonce-2", "replica-a", proof)
    assert not auth.ack_holds(TOKEN, "nonce-1", "replica-b", proof)
    assert not auth.ack_holds(b"another-token-0123456789abcdef00", "nonce-1", "replica-a", proof)


def test_a_weak_token_is_named() -> None:
    assert auth.check_token(b"short") is not None
    assert auth.check_token(b"has a space inside the token 0123") is not None
    assert auth.check_token(TOKEN) is None


# -- replicas and restore routes -------------------------------------------------------------


def replica(save: str = "aaaaaaaa", crc: str = "00000001") -> Replica:
    return Replica.model_validate(
        {
            "run_id": "run",
            "checkpoint": "step-10",
            "name": "step-10",
            "save": save,
            "node_rank": 1,
            "nodes": 2,
            "step": 10,
            "layout": "dcp",
            "writer": "cluster-2",
            "host": "node-1",
            "peer": "p1",
            "address": "10.0.0.2:9465",
            "created_at": "2026-12-06T12:00:00Z",
            "total_bytes": 3,
            "files": [{"path": "a", "size": 3, "crc32c": crc}],
        }
    )


def test_an_acknowledgement_of_another_save_names_another_replica() -> None:
    assert replica_id(replica()) == replica_id(replica())
    assert replica_id(replica(save="bbbbbbbb")) != replica_id(replica())
    assert replica_id(replica(crc="00000002")) != replica_id(replica())


def test_a_seal_must_match_its_offer() -> None:
    offer = replica().offer()
    assert matches_offer(replica(), offer) is None
    assert matches_offer(replica(save="bbbbbbbb"), offer) is not None


@pytest.mark.parametrize("path", ["../escape", "/abs", "a//b", "a/./b", "C:/x"])
def test_an_offer_with_an_unsafe_path_does_not_parse(path: str) -> None:
    doc = replica().offer().model_dump(mode="json")
    doc["files"] = [{"path": path, "size": 3}]
    with pytest.raises(ManifestError):
        parse_offer(json.dumps(doc).encode())


def test_an_offer_naming_a_path_twice_or_under_a_file_does_not_parse() -> None:
    doc = replica().offer().model_dump(mode="json")
    for files in (
        [{"path": "a", "size": 1}, {"path": "a", "size": 1}],
        [{"path": "a", "size": 1}, {"path": "a/b", "size": 1}],
    ):
        doc["files"], doc["total_bytes"] = files, 2
        with pytest.raises(ManifestError):
            parse_offer(json.dumps(doc).encode())


def holding(hid: str, crc: str, digest: str | None = None) -> Holding:
    return Holding(
        id=hid,
        kind="replica",
        run_id="run",
        checkpoint="step-10",
        name="step-10",
        save="s",
        node_rank=1,
        files=[ManifestFile(path="a", size=3, crc32c=crc, digest=digest)],
    )


def test_only_a_holding_of_the_same_content_serves_a_file() -> None:
    wanted = [ManifestFile(path="a", size=3, crc32c="00000001", digest="d" * 64)]
    offers = {
        "stale:1": [holding("older-step", "00000009")],  # another save's bytes
        "forged:1": [holding("same-crc-other-digest", "00000001", "e" * 64)],
        "good:1": [holding("right", "00000001", "d" * 64)],
        "plain:1": [holding("no-digest", "00000001")],
    }
    found = routes(wanted, offers)
    assert sorted(found["a"]) == [("good:1", "right", 0), ("plain:1", "no-digest", 0)]
    assert routes([ManifestFile(path="b", size=3, crc32c="00000001")], offers) == {}


def test_chunks_tile_a_file_exactly() -> None:
    for size in (0, 1, 8 * 1024 * 1024, 8 * 1024 * 1024 + 1, 100_000_000):
        spans = chunk_spans(size)
        assert sum(n for _, n in spans) == size
        assert all(o % (1024 * 1024) == 0 for o, _ in spans)
        assert [o for o, _ in spans] == sorted({o for o, _ in spans})


# -- ckptd status ------------------------------------------------------------------------------


def test_status_says_which_way_the_emergency_checkpoint_was_safe_and_every_hand_off() -> None:
    from ckptd.cli.peersview import peers_text

    doc = {
        "preemption": {"notice": True, "safe_via": "peer", "safe_after_s": 3.2},
        "peers": {
            "address": "10.0.0.1:9465",
            "failure_domain": "zone-a",
            "known": [{"node": 1}],
            "replicas": {"count": 1, "bytes": 2**30, "quota_bytes": 4 * 2**30},
            "replication": {
                "run": {
                    "checkpoint": "step-5",
                    "emergency": True,
                    "outcome": "safe",
                    "acknowledged_after_s": 1.5,
                    "peers": [{"address": "10.0.0.2:9465", "outcome": "acknowledged"}],
                },
                "other": {
                    "checkpoint": "step-9",
                    "emergency": False,
                    "outcome": "not_safe",
                    "peers": [{"address": "10.0.0.2:9465", "outcome": "quota"}],
                },
            },
            "handoffs": [
                {
                    "node": 0,
                    "run": "run",
                    "checkpoint": "step-5",
                    "bytes": 2**20,
                    "outcome": "committed",
                }
            ],
        },
    }
    lines = [str(t) for t in peers_text(doc)]
    assert "10.0.0.1:9465 (zone-a), 1 known; holding 1 replica(s)" in lines[0]
    assert "safe off the node via peer 3.2 s after the notice" in lines[1]
    assert any("run/step-5 (emergency): safe on 10.0.0.2:9465 in 1.5 s" in line for line in lines)
    assert any("other/step-9 (routine): NOT safe on peers (quota)" in line for line in lines)
    assert any("handed off node 0's run/step-5" in line and "committed" in line for line in lines)
    assert peers_text({"runs": {}}) == []
