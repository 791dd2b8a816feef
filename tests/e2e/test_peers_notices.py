"""Peers that go during the notice, on the namespace rig (issue 44 item 3): a part is never
given to a node under notice, a holder that gets a notice or dies mid-push is replaced
within ``ckptd.peers.liveness.REPLACED_WITHIN_SECONDS``, and each surviving node's part is
safe on a live peer within the window.

- two of four nodes noticed at once (both drilled together), both killed 2.4 s in, their
  links cut: nodes 2 and 3 each have their part on the other, never on 0 or 1
  (``make test`` runs this one: about 35 s);
- ``peers_faults``: the issue's case, three nodes, ``copies = 1``, node 0 noticed and
  killed 2.4 s in: node 2's part goes to node 1 (the ring put it on node 0);
- ``peers_faults``: a holder chosen before anything was known of it, killed with its
  link cut mid-push, with a notice of its own first or with none: the push resumes on
  the next candidate within the bound.

Nodes on 400 Mbit links, the store behind 40 Mbit (the issue's rig); the window is the
drill's deadline. ``PEERS_SCALE=N`` multiplies the parts and the window together. The
timings printed are docs/benchmarks.md's "Peers that go during the notice".
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from functools import partial
from typing import Any

import pytest

from ckptd.peers.liveness import REPLACED_WITHIN_SECONDS
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
STORE = Shape(40)
MiB = 1024 * 1024
SCALE = float(os.environ.get("PEERS_SCALE", "1"))
WINDOW = 20 * SCALE
KILLED_AFTER = 2.4  # seconds after the notice, as in the issue
SLACK = 1.5  # on top of a documented bound: a loaded 2-core machine


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerRig]:
    with peer_rig(tmp_path_factory.mktemp("peers-notices"), store=STORE) as pr:
        yield pr


@pytest.fixture
def pr(shared: PeerRig, request: pytest.FixtureRequest) -> Iterator[PeerRig]:
    shared.reset(request.node.name[:40].replace("[", "-").replace("]", ""))
    yield shared
    shared.reset("done")


def cluster(pr: PeerRig, count: int) -> list[PeerNode]:
    nodes = [pr.add_node(r, nodes=count, shape=NODE) for r in range(count)]
    for node in nodes:
        wait_for_peers(node, count - 1)
    return nodes


def drill(node: PeerNode, window: float = WINDOW) -> threading.Thread:
    """``ckptd drill`` on ``node`` in the background (a notice of its own, published to
    the run's NOTICE); what it answers does not matter here (the node may be killed)."""

    def run() -> None:
        node.cli("drill", "--deadline", str(window), "--json", timeout=window + 240)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def noticed(node: PeerNode) -> bool:
    return bool(node.status()["preemption"].get("notice"))


def write_parts(nodes: list[PeerNode], name: str, mib: dict[int, float]) -> None:
    """Once every node is in emergency mode, each writes its share of ``name`` (node 0's
    ``.metadata`` last, as DCP's coordinator does)."""
    for node in nodes:
        wait_until(partial(noticed, node), 30, f"{node.host.name} in emergency mode", 0.2)
    for node in [*nodes[1:], nodes[0]]:
        base = node.run_dir / name
        base.mkdir(parents=True)
        size = round(mib.get(node.rank, 16) * SCALE * MiB)
        (base / f"__{node.rank}_0.distcp").write_bytes(os.urandom(size))
    (nodes[0].run_dir / name / ".metadata").write_bytes(os.urandom(1200))


def kill_once_announced(pr: PeerRig, name: str, noticed_at: float, doomed: list[PeerNode]) -> None:
    """Kill ``doomed`` (``kill -9``, links cut) ``KILLED_AFTER`` s after the notice, and
    not before the save is announced (then the survivors' pushes are under way: a node
    killed before that leaves no save to push, which is another test)."""
    wait_until(
        lambda: read_store(pr, f"{name}/ckptd.announce.json"),
        30,
        f"{name} announced",
        interval=0.05,
        details=pr.logs,
    )
    time.sleep(max(0.3, noticed_at + KILLED_AFTER - time.monotonic()))
    for node in doomed:
        pr.kill(node)


def wait_safe(pr: PeerRig, node: PeerNode, live: set[int]) -> dict[str, Any]:
    found: dict[str, Any] = wait_until(
        lambda: safe_on_live_peer(node, live),
        WINDOW + 30,
        f"node {node.rank}'s part safe on a live peer",
        interval=0.5,
        details=pr.logs,
    )
    return found


def safe_on_live_peer(node: PeerNode, live: set[int]) -> dict[str, Any] | None:
    """This node's ``emergency_checkpoint_safe`` (via a peer) once its replication's
    current holders are all alive; else None."""
    safe = node.daemon.events_named("emergency_checkpoint_safe", via="peer")
    if not safe:
        return None
    replication = node.status()["peers"]["replication"].get(RUN_ID, {})
    holders = {p["node"] for p in replication.get("peers", []) if p["outcome"] == "acknowledged"}
    if replication.get("outcome") != "safe" or not holders or not holders <= live:
        return None
    return {"after_s": safe[0]["after_s"], "holders": sorted(holders), "pushes": replication}


def pushed_to(node: PeerNode) -> set[int]:
    """Every node this node's push went to (acknowledged, refused or abandoned)."""
    replication = node.status()["peers"]["replication"].get(RUN_ID, {})
    return {p["node"] for p in replication.get("peers", [])}


def test_two_of_four_noticed_together_and_killed_each_survivors_part_is_safe_on_the_other(
    pr: PeerRig,
) -> None:
    nodes = cluster(pr, 4)
    noticed_at = time.monotonic()
    drills = [drill(nodes[0]), drill(nodes[1])]
    write_parts(nodes, "step-5", {})
    kill_once_announced(pr, "step-5", noticed_at, nodes[:2])
    survivors = {2, 3}
    found = {n.rank: wait_safe(pr, n, survivors) for n in nodes[2:]}
    print(
        "two of four noticed: "
        + ", ".join(f"node {r} safe on {f['holders']} {f['after_s']} s" for r, f in found.items())
    )
    assert {r: f["holders"] for r, f in found.items()} == {2: [3], 3: [2]}
    for rank, f in found.items():
        assert f["after_s"] < WINDOW, (rank, f)
        # Never pushed to a node under notice, not even tried.
        assert pushed_to(nodes[rank]) <= survivors, f["pushes"]
    for thread in drills:
        thread.join(1)


@pytest.mark.peers_faults
def test_the_issue_case_three_nodes_node_0_noticed_and_killed_node_2s_part_goes_to_node_1(
    pr: PeerRig,
) -> None:
    nodes = cluster(pr, 3)
    noticed_at = time.monotonic()
    thread = drill(nodes[0])
    write_parts(nodes, "step-6", {})
    kill_once_announced(pr, "step-6", noticed_at, nodes[:1])
    found = {n.rank: wait_safe(pr, n, {1, 2}) for n in nodes[1:]}
    print(
        "three nodes, node 0 noticed: "
        + ", ".join(f"node {r} safe on {f['holders']} {f['after_s']} s" for r, f in found.items())
    )
    assert {r: f["holders"] for r, f in found.items()} == {1: [2], 2: [1]}
    assert all(f["after_s"] < WINDOW for f in found.values()), found
    assert 0 not in pushed_to(nodes[2])
    thread.join(1)


@pytest.mark.peers_faults
@pytest.mark.parametrize("notice_first", [True, False], ids=["noticed-then-killed", "killed"])
def test_a_holder_killed_with_its_link_cut_mid_push_is_replaced_within_the_bound(
    pr: PeerRig, notice_first: bool
) -> None:
    # Four nodes, node 0 noticed: node 2's ring is 3, 0, 1 and 0 is under notice, so its
    # part goes to node 3, which then goes mid-push (its notice and the kill, or the
    # kill alone: a reclaim whose notice never got out), and node 1 takes the part.
    nodes = cluster(pr, 4)
    holder, origin = nodes[3], nodes[2]
    thread = drill(nodes[0])
    write_parts(nodes, "step-7", {2: 96})
    incoming = holder.replicas / "incoming"

    def receiving() -> bool:
        return sum(p.stat().st_size for p in incoming.rglob("*.distcp") if p.is_file()) > 8 * MiB

    wait_until(receiving, 60, "node 3 receiving node 2's part", interval=0.02)
    if notice_first:
        drill(holder)
        time.sleep(KILLED_AFTER)
    pr.kill(holder)
    killed, killed_wall = time.monotonic(), time.time()
    found = wait_safe(pr, origin, {1})
    abandoned = origin.daemon.events_named("peer_push_abandoned", node=3)
    assert abandoned, origin.daemon.log_text()[-3000:]
    why = abandoned[0]["why"]
    after = abandoned[0]["after_s"]
    print(
        f"holder {'noticed then killed' if notice_first else 'killed'} mid-push: abandoned "
        f"({why}) {after} s into its push; safe on node 1 {found['after_s']} s after the "
        f"notice, {time.monotonic() - killed:.1f} s after the kill (polled)"
    )
    assert found["holders"] == [1]
    assert found["after_s"] < WINDOW
    if notice_first:
        assert why == "notice"
    else:
        assert why in ("silent", "stalled")
        # Abandoned within the bound of the kill (its last answer came before it).
        logged = datetime.fromisoformat(abandoned[0]["timestamp"]).timestamp()
        assert logged - killed_wall <= REPLACED_WITHIN_SECONDS + SLACK, logged - killed_wall
    thread.join(1)
