"""Peer replication against the store alone, side by side in one run, on the namespace rig.

```sh
.venv/bin/python bench/bench_peers.py                         # 0.5, 1, 2, 4 GiB (~15 min on 2 cores)
.venv/bin/python bench/bench_peers.py --sizes-gib 0.25,0.5    # quick (~4 min)
.venv/bin/python bench/bench_peers.py --json bench/results/peers.json
```

Root and the kernel's network namespaces, veth, tbf and nftables (``tests/support/
netns.py``). Two nodes on ``--node-mbit`` links (default 1000) and a SeaweedFS in its own
namespace behind a ``--store-mbit`` link (default 250: a quarter of a node's), every link
shaped at both ends and measured before use; one ``ckptd run`` per node with ``[cluster]
nodes = 2`` and ``[peers]`` (emergency pushes unpaced, the default).

1. **Safe off the node**, per part size: a drill on node 0, then node 1 writes a 1 MiB
   shard and node 0 its part (files of 256 MiB) and DCP's ``.metadata`` last. From the
   drill's timings: the part complete -> acknowledged by the peer (``replicated_after_s``)
   and -> node 0's part in the store (``stored_after_s``), in one run as the daemon does
   it (the push first, the store upload after it; files the store took early while the
   part was being written are the store's head start). Goal: the peer within
   size / (0.8 x the measured node link) + 1 s, and >= 3x sooner than the store.
2. **Restore on a replacement node** (node 0 killed, a new host restores the whole
   checkpoint): ``ckptd restore --latest`` with ``[peers]`` (peers first) and without
   (the store alone), one after the other into fresh dirs, the store's link at
   ``--restore-store-mbit`` (default 125, an eighth of a node's) meanwhile. Goal: >= 5x
   faster from peers (a restore is bounded by the ratio of the links).
3. **Interference**: a saturating TCP flow from node 0 to a third host (the trainer's
   collective traffic) for ``--flow-seconds``, alone, then while node 0 replicates a
   routine checkpoint with ``periodic = true`` at ``rate_mbit`` = ``--rate-fraction`` x
   the node link (the default ``rate_mbit`` of 1000 is 1 % of a 100 Gbit link; the rig's
   links are 1 Gbit), then unpaced (as an emergency push goes). The store's link is cut to
   5 Mbit in this phase so that only the peer push competes. Goal: the flow loses <= 3 %
   with the default pace.

Figures are one run each (the sizes are the repetitions); the header gives the machine
and its load. A run on a loaded machine under-states the peer link (Python on 2 cores
sets the rate, not the qdisc): the measured link rate is what the goals are held to.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GIB, MIB, machine_line  # noqa: E402

from tests.support.daemon import wait_until  # noqa: E402
from tests.support.netns import Shape  # noqa: E402
from tests.support.peer_cluster import (  # noqa: E402
    S3_ENV,
    PeerNode,
    PeerRig,
    peer_rig,
    wait_for_peers,
)

FILE_BYTES = 256 * MIB


def write_part(base: Path, total: int, rank: int) -> None:
    """``total`` bytes as ``__<rank>_<i>.distcp`` files of at most 256 MiB (each its own
    random 4 MiB block repeated: real bytes to checksum, cheap to make), fsynced."""
    base.mkdir(parents=True, exist_ok=True)
    left, i = total, 0
    while left > 0:
        size = min(FILE_BYTES, left)
        block = os.urandom(4 * MIB)
        with (base / f"__{rank}_{i}.distcp").open("wb") as fh:
            done = 0
            while done < size:
                done += fh.write(block[: min(len(block), size - done)])
            fh.flush()
            os.fsync(fh.fileno())
        left, i = left - size, i + 1


def drill_while(node: PeerNode, deadline: float) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        done = node.cli("drill", "--deadline", str(deadline), "--json", timeout=deadline + 120)
        out.update(json.loads(done.stdout or "{}"))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def in_emergency(nodes: list[PeerNode]) -> None:
    for node in nodes:
        wait_until(lambda n=node: n.status()["preemption"].get("notice"), 30, "emergency mode")


def restore_time(node: PeerNode, to: Path, *, peers: bool) -> tuple[float, dict[str, Any]]:
    """``ckptd restore --latest`` inside ``node``'s namespace, with or without [peers]."""
    config = node.config
    if not peers:
        config = node.root / "store-only.toml"
        text = node.config.read_text()
        config.write_text(text.replace("[peers]\nenabled = true", "[peers]\nenabled = false"))
    argv = node.host.argv(
        [
            *(sys.executable, "-m", "ckptd", "restore", "--run", "run", "--latest"),
            *("--to", str(to), "--json", "--no-progress", "--config", str(config)),
        ]
    )
    started = time.monotonic()
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, **S3_ENV}, timeout=3600
    )
    took = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return took, json.loads(done.stdout)


def one_size(
    pr: PeerRig, gib: float, args: argparse.Namespace, rates: dict[str, float]
) -> dict[str, Any]:
    pr.reset(f"size-{gib:g}")
    n0 = pr.add_node(0, nodes=2, shape=Shape(args.node_mbit), peers={"quota_gib": 2 * gib + 1})
    n1 = pr.add_node(1, nodes=2, shape=Shape(args.node_mbit), peers={"quota_gib": 2 * gib + 1})
    wait_for_peers(n0, 1)
    wait_for_peers(n1, 1)
    total = int(gib * GIB)
    thread, doc = drill_while(n0, 3600)
    in_emergency([n0, n1])
    write_part(n1.run_dir / "step-1", MIB, 1)
    write_part(n0.run_dir / "step-1", total, 0)
    (n0.run_dir / "step-1" / ".metadata").write_bytes(os.urandom(1000))
    thread.join()
    complete = doc["complete_after_s"]
    peer = doc["replicated_after_s"] - complete
    store = doc["stored_after_s"] - complete
    goal = total * 8 / (0.8 * rates["node"] * 1e6) + 1
    row: dict[str, Any] = {
        "gib": gib,
        "peer_s": round(peer, 2),
        "store_s": round(store, 2),
        "speedup": round(store / peer, 1),
        "peer_goal_s": round(goal, 2),
        "peer_within_goal": peer <= goal,
    }
    print(
        f"  {gib:g} GiB: peer {peer:.1f} s (goal {goal:.1f} s), store {store:.1f} s, x{store / peer:.1f}",
        flush=True,
    )
    if gib in args.restore_sizes:
        pr.kill(n0)
        n2 = pr.add_node(0, nodes=2, shape=Shape(args.node_mbit), name=f"new-{gib:g}")
        wait_for_peers(n2, 1)
        store_shape = pr.store_host.shape
        pr.rig.reshape(pr.store_host, Shape(args.restore_store_mbit))
        try:
            t_peer, via_peer = restore_time(n2, pr.work / f"restore-peer-{gib:g}", peers=True)
            t_store, via_store = restore_time(n2, pr.work / f"restore-store-{gib:g}", peers=False)
        finally:
            pr.rig.reshape(pr.store_host, store_shape)
        assert via_peer["tier"] == "peers" and via_store["tier"] == "primary"
        row.update(
            restore_peer_s=round(t_peer, 2),
            restore_store_s=round(t_store, 2),
            restore_speedup=round(t_store / t_peer, 1),
        )
        print(
            f"  restore: peers {t_peer:.1f} s, store {t_store:.1f} s, x{t_store / t_peer:.1f}",
            flush=True,
        )
    return row


def flow(pr: PeerRig, sender: PeerNode, sink_host: Any, seconds: float) -> float:
    """Mbit/s of a saturating flow from ``sender`` to ``sink_host`` for ``seconds``."""
    server = sink_host.popen(
        [sys.executable, "-m", "tests.support.netflow", "sink", sink_host.address, "5301"],
        stdout=subprocess.PIPE,
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()
        done = sender.host.run(
            [
                sys.executable,
                "-m",
                "tests.support.netflow",
                "pace",
                sink_host.address,
                "5301",
                str(seconds),
            ],
            check=True,
        )
        return float(done.stdout.strip())
    finally:
        server.kill()
        server.wait()


def interference(pr: PeerRig, args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    store_shape = pr.store_host.shape
    # Only the peer push may compete with the flow: the store's link is cut to 5 Mbit
    # meanwhile (at most 0.5 % of a node's link goes to the store upload).
    pr.rig.reshape(pr.store_host, Shape(5))
    try:
        # The same routine checkpoint shipped with peers off: what the daemon's own work
        # (reading, checksumming, the store upload) costs a flow on this machine's shared
        # cores, so the push's own cost is the difference.
        rows["peers off"] = interference_once(pr, args, "peers off", None)
        for label, rate in (("paced", args.rate_fraction * args.node_mbit), ("unpaced", 0.0)):
            rows[label] = interference_once(pr, args, label, rate)
    finally:
        pr.rig.reshape(pr.store_host, store_shape)
    return rows


def interference_once(
    pr: PeerRig, args: argparse.Namespace, label: str, rate: float | None
) -> dict[str, Any]:
    """``rate`` None: peers off; 0: unpaced."""
    pr.reset(f"interference-{label.replace(' ', '-')}")
    peers: dict[str, Any] = (
        {"enabled": False}
        if rate is None
        else {"periodic": True, "rate_mbit": rate, "quota_gib": 4}
    )
    n0 = pr.add_node(0, nodes=2, shape=Shape(args.node_mbit), peers=peers)
    n1 = pr.add_node(1, nodes=2, shape=Shape(args.node_mbit), peers=peers)
    trainer_peer = pr.rig.add_host(f"trainer-{label.replace(' ', '-')}", Shape(args.node_mbit))
    try:
        if rate is not None:
            wait_for_peers(n0, 1)
            wait_for_peers(n1, 1)
        alone = [flow(pr, n0, trainer_peer, args.flow_seconds)]
        # A routine checkpoint whose push outlasts two flows at the pace.
        pace = args.rate_fraction * args.node_mbit if rate is None else rate
        size = int((pace or args.node_mbit) * 1e6 / 8 * args.flow_seconds * 4)
        write_part(n1.run_dir / "step-2", MIB, 1)
        write_part(n0.run_dir / "step-2", min(size, 3 * GIB), 0)
        (n0.run_dir / "step-2" / ".metadata").write_bytes(os.urandom(1000))
        started = "ckptd_peer_sent_bytes_total" if rate is not None else "ckptd_upload_bytes_total"
        wait_until(
            lambda: n0.daemon.metric(started, **({} if rate is not None else {"run": "run"})) > 0,
            120,
            "the push (or upload) to begin",
            interval=0.2,
            details=pr.logs,
        )
        during = [flow(pr, n0, trainer_peer, args.flow_seconds) for _ in range(2)]
        pushing = True
        if rate is not None:
            pushing = n0.status()["peers"]["replication"]["run"]["outcome"] == "pushing"
            wait_until(
                lambda: n0.status()["peers"]["replication"]["run"]["outcome"] != "pushing",
                3600,
                "the push to end",
                interval=1,
            )
        alone.append(flow(pr, n0, trainer_peer, args.flow_seconds))
    finally:
        pr.rig.remove_host(trainer_peer)
    base, under = statistics.median(alone), statistics.median(during)
    print(
        f"  {label} ({'-' if rate is None else rate or 'unpaced'} Mbit/s): flow alone {alone}, "
        f"during the checkpoint {during}"
        f"{'' if pushing else ' (the push ended during the flows)'}",
        flush=True,
    )
    return {
        "replication_mbit": rate or None,
        "flow_alone_mbit": [round(x, 1) for x in alone],
        "flow_during_mbit": [round(x, 1) for x in during],
        "push_outlasted_flows": pushing,
        "loss_percent": round(100 * (1 - under / base), 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gib", default="0.5,1,2,4")
    p.add_argument("--restore-sizes", default="0.5,1", help="sizes whose restore is timed")
    p.add_argument("--node-mbit", type=float, default=1000)
    p.add_argument("--store-mbit", type=float, default=250)
    p.add_argument(
        "--restore-store-mbit",
        type=float,
        default=125,
        help="the store's link while restores are timed (default: an eighth of a node's)",
    )
    p.add_argument("--rate-fraction", type=float, default=0.01)
    p.add_argument("--flow-seconds", type=float, default=15)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, data)")
    args = p.parse_args()
    # A SIGTERM runs the finally blocks: every namespace, daemon and store goes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [float(s) for s in args.sizes_gib.split(",")]
    args.restore_sizes = {float(s) for s in args.restore_sizes.split(",") if s}
    print(machine_line(), flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    try:
        results = measure(work, sizes, args)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)  # GiBs: parts, replicas, the store
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


def measure(work: Path, sizes: list[float], args: argparse.Namespace) -> dict[str, Any]:
    with peer_rig(work, store=Shape(args.store_mbit)) as pr:
        probe_a = pr.rig.add_host("probe-a", Shape(args.node_mbit))
        probe_b = pr.rig.add_host("probe-b", Shape(args.node_mbit))
        rates = {
            "node": pr.rig.measure(probe_a, probe_b, mib=64),
            "store": pr.rig.measure(probe_a, pr.store_host, mib=16),
        }
        pr.rig.reshape(pr.store_host, Shape(args.restore_store_mbit))
        rates["store_while_restoring"] = pr.rig.measure(pr.store_host, probe_b, mib=8)
        pr.rig.reshape(pr.store_host, Shape(args.store_mbit))
        pr.rig.remove_host(probe_a)
        pr.rig.remove_host(probe_b)
        print(
            f"links: node {rates['node']:.0f} Mbit/s (shaped {args.node_mbit:g}), store "
            f"{rates['store']:.0f} Mbit/s (shaped {args.store_mbit:g}), store while restoring "
            f"{rates['store_while_restoring']:.0f} Mbit/s (shaped {args.restore_store_mbit:g})",
            flush=True,
        )
        results: dict[str, Any] = {"machine": machine_line(), "links_mbit": rates, "sizes": []}
        for gib in sizes:
            results["sizes"].append(one_size(pr, gib, args, rates))
        results["interference"] = interference(pr, args)
        results["load_at_end"] = os.getloadavg()
    return results


if __name__ == "__main__":
    sys.exit(main())
