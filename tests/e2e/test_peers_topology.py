"""Peer replication's topologies and faults on the namespace rig, with daemons and a test
that writes each node's share of a DCP checkpoint during a drill:

- three nodes (an odd count) in two failure domains: each part goes to a node of the
  other domain where there is one, and a replacement with a new address restores every
  byte from the peers;
- 1 % of the packets lost both ways on the nodes' links: the part is still acknowledged,
  verified byte for byte;
- a peer whose quota cannot take the part: never acknowledged; the store commits it and
  a restore takes that part from the store;
- the node and its peer both dead: a replacement restores from the store within 30 s.

One rig and one store for the module (each test its own prefix and nodes).
``PEERS_SCALE=N`` multiplies every part's size (the full campaign: docs/peers.md).

The three-node test runs in ``make test`` beside the emergency E2E test
(``test_peers_emergency.py``, the core promise). The three fault tests, about 40 s more of
the rig, carry the marker ``peers_faults``: ``make test`` leaves them out, ``pytest -m
peers_faults tests/e2e`` runs them (docs/development.md); the loopback tests of
``tests/integration/test_peer_*.py`` prove each fault's refusal in ``make test``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import wait_until
from tests.support.netns import Shape
from tests.support.peer_cluster import (
    RUN_ID,
    PeerNode,
    PeerRig,
    peer_rig,
    read_store,
    wait_for_peers,
)

NODE = Shape(400)
STORE = Shape(100)
MiB = 1024 * 1024
SCALE = float(os.environ.get("PEERS_SCALE", "1"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerRig]:
    with peer_rig(tmp_path_factory.mktemp("peers-rig"), store=STORE) as pr:
        yield pr


@pytest.fixture
def pr(shared: PeerRig, request: pytest.FixtureRequest) -> Iterator[PeerRig]:
    shared.reset(request.node.name[:40].replace("[", "-").replace("]", ""))
    yield shared
    shared.reset("done")


def emergency(
    nodes: list[PeerNode], name: str, mib: int, window: float = 20 * SCALE
) -> tuple[dict[str, Any], dict[int, dict[str, bytes]]]:
    """A drill on node 0; once every node is in emergency mode, each writes its share of
    ``name`` (node 0's ``.metadata`` last, as DCP's coordinator does). The drill's
    timings and what each node wrote."""
    drill: dict[str, Any] = {}

    def run() -> None:
        done = nodes[0].cli("drill", "--deadline", str(window), "--json", timeout=window + 240)
        drill.update(json.loads(done.stdout or "{}"), rc=done.returncode)

    thread = threading.Thread(target=run)
    thread.start()
    for node in nodes:
        wait_until(
            lambda n=node: n.status()["preemption"].get("notice"),
            30,
            f"{node.host.name} in emergency mode",
            interval=0.2,
        )
    written: dict[int, dict[str, bytes]] = {}
    for node in [*nodes[1:], nodes[0]]:
        base = node.run_dir / name
        base.mkdir(parents=True)
        data = os.urandom(round(mib * SCALE * MiB))
        (base / f"__{node.rank}_0.distcp").write_bytes(data)
        written[node.rank] = {f"__{node.rank}_0.distcp": data}
    metadata = os.urandom(1200)
    (nodes[0].run_dir / name / ".metadata").write_bytes(metadata)
    written[0][".metadata"] = metadata
    thread.join(window + 250)
    return drill, written


def committed(pr: PeerRig, name: str, timeout: float = 120) -> dict[str, Any]:
    body = wait_until(
        lambda: read_store(pr, f"{name}/ckptd.manifest.json"),
        timeout,
        f"{name} committed",
        interval=0.5,
        details=pr.logs,
    )
    return dict(json.loads(body))


def restored(to: Path, name: str) -> dict[str, bytes]:
    base = to / name
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def flat(written: dict[int, dict[str, bytes]]) -> dict[str, bytes]:
    return {k: v for files in written.values() for k, v in files.items()}


def holder_of(node: PeerNode) -> list[int]:
    replication = node.status()["peers"]["replication"][RUN_ID]
    return [p["node"] for p in replication["peers"] if p.get("outcome") == "acknowledged"]


def test_three_nodes_place_parts_across_failure_domains_and_a_replacement_restores_from_peers(
    pr: PeerRig, tmp_path: Path
) -> None:
    zones = {0: "zone-a", 1: "zone-a", 2: "zone-b"}
    nodes = [
        pr.add_node(r, nodes=3, shape=NODE, peers={"failure_domain": zones[r]}) for r in range(3)
    ]
    for node in nodes:
        wait_for_peers(node, 2)
    drill, written = emergency(nodes, "step-7", mib=8)
    assert drill["safe_via"] == "peer", drill
    wait_until(lambda: all(holder_of(n) for n in nodes), 60, "every part acknowledged")
    # Zone a's parts go to zone b's one node; zone b's to the nearest of zone a that has
    # no notice: node 1, since node 0 (the ring's first) is the node under notice.
    assert {n.rank: holder_of(n) for n in nodes} == {0: [2], 1: [2], 2: [1]}
    manifest = committed(pr, "step-7")
    assert manifest["nodes"] == 3

    pr.kill(nodes[2])
    replacement = pr.add_node(
        2, nodes=3, shape=NODE, name="node-2-new", peers={"failure_domain": "zone-b"}
    )
    out = replacement.restore_cli(tmp_path / "to")
    assert out["tier"] == "peers" and out["peer_bytes"] == out["total_bytes"], out
    assert restored(tmp_path / "to", "step-7") == flat(written)


@pytest.mark.peers_faults
def test_one_percent_packet_loss_still_gets_the_part_acknowledged_verified(pr: PeerRig) -> None:
    lossy = Shape(NODE.rate_mbit, loss_percent=1.0)
    nodes = [pr.add_node(r, nodes=2, shape=lossy) for r in range(2)]
    for node in nodes:
        wait_for_peers(node, 1)
    drill, written = emergency(nodes, "step-3", mib=24)
    assert drill["safe_via"] == "peer", drill
    held = nodes[1].replicas / "held"
    (replica,) = [d for d in held.iterdir() if (d / "data" / "__0_0.distcp").exists()]
    assert (replica / "data" / "__0_0.distcp").read_bytes() == written[0]["__0_0.distcp"]
    assert (replica / "data" / ".metadata").read_bytes() == written[0][".metadata"]


@pytest.mark.peers_faults
def test_a_peer_whose_quota_is_full_never_acknowledges_and_the_store_takes_the_part(
    pr: PeerRig, tmp_path: Path
) -> None:
    n0 = pr.add_node(0, nodes=2, shape=NODE)
    n1 = pr.add_node(1, nodes=2, shape=NODE, peers={"quota_gib": 0.004})  # 4 MiB: too small
    for node in (n0, n1):
        wait_for_peers(node, 1)
    drill, written = emergency([n0, n1], "step-4", mib=8)
    assert drill["safe_via"] != "peer", drill
    assert n0.daemon.metric("ckptd_peer_pushes_total", run=RUN_ID, outcome="acknowledged") == 0
    assert n1.daemon.metric("ckptd_peer_replicas_sealed_total") == 0
    # Node 1's part went to no peer: its one peer, node 0, is under notice.
    assert n1.status()["peers"]["replication"][RUN_ID]["peers"] == []
    committed(pr, "step-4")
    out = n1.restore_cli(tmp_path / "to")
    # Neither part is on a peer: both from the store.
    assert out["peer_bytes"] == 0, out
    assert restored(tmp_path / "to", "step-4") == flat(written)


@pytest.mark.peers_faults
def test_with_node_and_peer_both_dead_a_replacement_restores_from_the_store_within_30s(
    pr: PeerRig, tmp_path: Path
) -> None:
    nodes = [pr.add_node(r, nodes=2, shape=NODE) for r in range(2)]
    for node in nodes:
        wait_for_peers(node, 1)
    drill, written = emergency(nodes, "step-9", mib=8)
    assert drill["safe_via"] == "peer", drill
    committed(pr, "step-9")
    for node in nodes:
        pr.kill(node)
    replacement = pr.add_node(0, nodes=2, shape=NODE, name="node-0-new")
    started = time.monotonic()
    out = replacement.restore_cli(tmp_path / "to")
    took = time.monotonic() - started
    assert out["tier"] == "primary" and out["peer_bytes"] == 0, out
    assert took < 30, f"the restore took {took:.1f} s"
    assert restored(tmp_path / "to", "step-9") == flat(written)
