"""A 4-node cluster restore that reads each byte from the store once (#46, bench (b)).

```sh
.venv/bin/python bench/bench_cluster_restore.py             # 2 GiB, 3 rounds (~12 min)
.venv/bin/python bench/bench_cluster_restore.py --smoke     # 64 MiB, 1 round (~30 s)
.venv/bin/python bench/bench_cluster_restore.py --log-dir bench/results/cluster-restore
```

Root and the kernel's network namespaces (``tests/support/netns.py``), on the rig of
``bench/bench_no_peer.py`` (``tests/support/peer_cluster.py``): a SeaweedFS in a namespace
of its own behind a ``--store-mbit`` link, and four node hosts behind ``--node-mbit``
links (default: the store's link at a quarter of the nodes'), each link shaped both ways.
A DCP-like checkpoint of ``--mib`` MiB (``--shards`` shards and a ``.metadata``) is
committed once by ``ckptd run --once`` from the test host (the store's link unshaped
while it uploads), then, in every round, side by side in rotating order:

- **every node from the store**: the four nodes run ``ckptd restore --latest --json`` at
  once with ``[peers] enabled = false`` (each reads the whole checkpoint from the store);
- **shared restore**: the same four at once with ``[peers] enabled = true`` (and
  ``share_restores``), ``cluster.nodes = 4``, ``cluster.node_rank`` 0..3, the cluster's
  token file, ``listen`` on the host's address: they meet through records in the store,
  each fetches a share and reads the rest from the others.

Per case: the wall time from the first start to the last node done (median, range), each
node's wall, the bytes out of the store **counted from outside ckptd** (``tx_bytes`` of
the store host's veth end, read in its namespace before and after; every request, listing
and TCP/IP header included) as a multiple of the checkpoint's size, and the sums of the
nodes' own ``store_bytes`` and ``peer_bytes`` (their ``--json``). Every node's tree is
compared, file by file (sha256), with the bytes committed, in every case and round; no
staging directory may be left beside it. Between cases the trees are deleted and the disk
synced, untimed. Goals (#46 (b)): the shared restore at least 2.5x faster than every node
from the store, and at most 1.1x the checkpoint's bytes out of the store.

The restores run with ``--log-level info``; their stderr is kept under ``--log-dir`` (and
its tail printed when one fails).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MIB, machine_line  # noqa: E402

from ckptd.store.restore.staging import STAGING_PREFIX as STAGING  # noqa: E402
from tests.support.netns import Host, Shape  # noqa: E402
from tests.support.peer_cluster import (  # noqa: E402
    BUCKET,
    RUN_ID,
    S3_ENV,
    PeerNode,
    PeerRig,
    peer_rig,
)

NODES = 4
NAME = "step-10"
EVERY = "every node from the store"
SHARED = "shared restore"
CASES = (EVERY, SHARED)
GOAL_SPEEDUP = 2.5
GOAL_STORE_MULTIPLE = 1.1
RESTORE_TIMEOUT = 1200.0


def write_checkpoint(base: Path, total: int, shards: int) -> dict[str, str]:
    """A DCP checkpoint of about ``total`` bytes: ``shards`` shards of random bytes and a
    ``.metadata`` (last); {relative path: sha256}."""
    base.mkdir(parents=True)
    digests: dict[str, str] = {}
    each = total // shards
    for i in range(shards):
        name = f"__{i}_0.distcp"
        digest = hashlib.sha256()
        with open(base / name, "wb") as fh:
            left = each
            while left > 0:
                block = os.urandom(min(left, 4 * MIB))
                fh.write(block)
                digest.update(block)
                left -= len(block)
        digests[name] = digest.hexdigest()
    meta = os.urandom(4096)
    (base / ".metadata").write_bytes(meta)
    digests[".metadata"] = hashlib.sha256(meta).hexdigest()
    return digests


def commit_checkpoint(pr: PeerRig, work: Path, total: int, shards: int) -> dict[str, str]:
    """``ckptd run --once`` from the test host: the checkpoint committed in the store."""
    watch, state = work / "writer" / "run", work / "writer" / "state"
    digests = write_checkpoint(watch / NAME, total, shards)
    pr.ship_once(watch, state, timeout=1200)
    shutil.rmtree(watch, ignore_errors=True)  # the writer's disk: not needed any more
    return digests


def tx_bytes(host: Host) -> int:
    """Bytes ``host`` has sent on its link, read inside its namespace."""
    done = host.run(["cat", f"/sys/class/net/{host.dev}/statistics/tx_bytes"], check=True)
    return int(done.stdout.strip())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 * MIB):
            digest.update(block)
    return digest.hexdigest()


def check_tree(to: Path, digests: dict[str, str]) -> list[str]:
    """What is wrong with the tree restored into ``to`` (nothing: an empty list)."""
    tree = to / NAME
    if not tree.is_dir():
        return [f"{tree} missing"]
    problems = [f"left beside it: {p.name}" for p in to.iterdir() if p.name.startswith(STAGING)]
    found = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    if found != sorted(digests):
        problems.append(f"files {found} != {sorted(digests)}")
        return problems
    with ThreadPoolExecutor(2) as pool:
        got = dict(zip(found, pool.map(lambda rel: sha256_file(tree / rel), found), strict=True))
    problems += [f"{rel} differs" for rel in found if got[rel] != digests[rel]]
    return problems


@dataclass
class Outcome:
    wall: float  # first start to the last node done
    node_walls: list[float]
    store_tx: int  # the store's veth, from outside ckptd
    docs: list[dict[str, Any]]
    verified: int  # nodes whose tree matched the committed bytes (sha256, every file)


def sharing_records(pr: PeerRig) -> list[str]:
    client = pr.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{pr.prefix}/{RUN_ID}/.ckptd-sharing/")
    return [obj["Key"] for obj in listed.get("Contents", [])]


def run_case(
    pr: PeerRig,
    nodes: list[PeerNode],
    configs: list[Path],
    digests: dict[str, str],
    logs: Path,
    label: str,
    restore_root: Path | None = None,
) -> Outcome:
    """The four restores at once; their trees checked, then deleted."""
    targets = [
        (restore_root / f"node-{node.rank}") if restore_root else (node.root / "restored")
        for node in nodes
    ]
    for to in targets:
        shutil.rmtree(to, ignore_errors=True)
    subprocess.run(["sync"], check=False)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **S3_ENV}
    before = tx_bytes(pr.store_host)
    procs, outs, errs, starts = [], [], [], []
    started = time.monotonic()
    for node, config, to in zip(nodes, configs, targets, strict=True):
        out = open(logs / f"{label}-node{node.rank}.json", "w+")  # noqa: SIM115
        err = open(logs / f"{label}-node{node.rank}.log", "w+")  # noqa: SIM115
        argv = node.host.argv(
            [
                *(sys.executable, "-m", "ckptd", "restore", "--run", RUN_ID, "--latest"),
                *("--to", str(to), "--json", "--no-progress", "--log-level", "info"),
                *("--config", str(config)),
            ]
        )
        starts.append(time.monotonic())
        procs.append(subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=ROOT))
        outs.append(out)
        errs.append(err)
    ends: list[float | None] = [None] * len(procs)
    deadline = started + RESTORE_TIMEOUT
    while any(e is None for e in ends):
        for i, proc in enumerate(procs):
            if ends[i] is None and proc.poll() is not None:
                ends[i] = time.monotonic()
        if time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            raise RuntimeError(f"{label}: not done within {RESTORE_TIMEOUT:g} s")
        time.sleep(0.02)
    finished = [e for e in ends if e is not None]
    wall = max(finished) - started
    after = tx_bytes(pr.store_host)
    docs = []
    for i, proc in enumerate(procs):
        outs[i].seek(0)
        errs[i].seek(0)
        text, err_text = outs[i].read(), errs[i].read()
        outs[i].close()
        errs[i].close()
        if proc.returncode != 0:
            raise RuntimeError(f"{label}: node {i} exited {proc.returncode}:\n{err_text[-3000:]}")
        docs.append(json.loads(text))
    problems = [f"node {i}: {p}" for i, to in enumerate(targets) for p in check_tree(to, digests)]
    for to in targets:
        shutil.rmtree(to, ignore_errors=True)
    if problems:
        raise RuntimeError(f"{label}: a restored tree is wrong: {problems[:10]}")
    left = sharing_records(pr)
    if left:
        print(f"    odd: {len(left)} sharing record(s) left in the store after {label}")
        pr.client().delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in left]})
    return Outcome(
        wall,
        [e - s for e, s in zip(finished, starts, strict=True)],
        after - before,
        docs,
        len(targets),
    )


def measure(work: Path, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    prefix = f"cluster-{secrets.token_hex(3)}"
    restore_root = None
    if args.restore_dir:
        restore_root = Path(args.restore_dir) / f"ckptd-bench-cluster-restore-{prefix}"
    # The store's link unshaped while the checkpoint goes in; shaped for the restores.
    try:
        with peer_rig(work, store=Shape(), prefix=prefix) as pr:
            return _measure(pr, work, args, logs, restore_root)
    finally:
        if restore_root is not None:
            shutil.rmtree(restore_root, ignore_errors=True)


def _measure(
    pr: PeerRig, work: Path, args: argparse.Namespace, logs: Path, restore_root: Path | None
) -> dict[str, Any]:
    node_shape, store_shape = Shape(args.node_mbit), Shape(args.store_mbit)
    total = args.mib * MIB
    started = time.monotonic()
    digests = commit_checkpoint(pr, work, total, args.shards)
    committed = sum(
        o["Size"]
        for o in pr.client()
        .list_objects_v2(Bucket=BUCKET, Prefix=f"{pr.prefix}/{RUN_ID}/{NAME}/")
        .get("Contents", [])
        if not o["Key"].endswith(".json")
    )
    print(f"  committed {committed / MIB:.0f} MiB in {time.monotonic() - started:.1f} s")
    pr.rig.reshape(pr.store_host, store_shape)
    nodes = [
        pr.add_node(
            rank, nodes=NODES, shape=node_shape, start=False, peers={"share_restores": True}
        )
        for rank in range(NODES)
    ]
    shared = [n.config for n in nodes]
    alone = []
    for node in nodes:
        path = node.root / "store-only.toml"
        text = node.config.read_text()
        assert "[peers]\nenabled = true" in text
        path.write_text(text.replace("[peers]\nenabled = true", "[peers]\nenabled = false"))
        alone.append(path)
    mib = 16 if args.smoke else 64
    links = {
        "store -> node": pr.rig.measure(pr.store_host, nodes[0].host, mib=mib),
        "node -> store": pr.rig.measure(nodes[1].host, pr.store_host, mib=mib),
        "node -> node": pr.rig.measure(nodes[2].host, nodes[3].host, mib=mib * 4),
    }
    print("  links: " + ", ".join(f"{k} {v:.0f} Mbit/s" for k, v in links.items()))
    outcomes: dict[str, list[Outcome]] = {c: [] for c in CASES}
    for round_ in range(args.rounds):
        k = round_ % len(CASES)
        for case in CASES[k:] + CASES[:k]:
            label = f"r{round_ + 1}-{'shared' if case == SHARED else 'every'}"
            configs = shared if case == SHARED else alone
            got = run_case(pr, nodes, configs, digests, logs, label, restore_root)
            outcomes[case].append(got)
            print(
                f"  round {round_ + 1} {case}: {got.wall:.1f} s "
                f"(nodes {', '.join(f'{w:.1f}' for w in got.node_walls)}), "
                f"store sent {got.store_tx / committed:.2f}x",
                flush=True,
            )
    return {
        "committed_bytes": committed,
        "links_mbit": links,
        "outcomes": {
            c: [
                {
                    "wall": o.wall,
                    "node_walls": o.node_walls,
                    "store_tx": o.store_tx,
                    "store_bytes": sum(int(d["store_bytes"]) for d in o.docs),
                    "peer_bytes": sum(int(d["peer_bytes"]) for d in o.docs),
                    "tiers": [d.get("tier") for d in o.docs],
                    "restore_seconds": [d.get("seconds") for d in o.docs],
                    "trees_verified": o.verified,
                }
                for o in outs
            ]
            for c, outs in outcomes.items()
        },
    }


def span(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def table(result: dict[str, Any]) -> tuple[str, float, float]:
    """The Markdown table, the speed-up (medians) and the shared case's store multiple."""
    size = result["committed_bytes"]
    out = result["outcomes"]
    rows = [
        "| case | wall, first start to last node done: median (range) | each node's wall "
        "(median per node) | bytes out of the store (its veth): median (range), x checkpoint "
        "| nodes' store_bytes, x checkpoint | nodes' peer_bytes, x checkpoint |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in CASES:
        runs = out[case]
        walls = [r["wall"] for r in runs]
        per_node = [statistics.median(r["node_walls"][i] for r in runs) for i in range(NODES)]
        tx = [r["store_tx"] / size for r in runs]
        store = statistics.median(r["store_bytes"] / size for r in runs)
        peer = statistics.median(r["peer_bytes"] / size for r in runs)
        rows.append(
            f"| {case} | {statistics.median(walls):.1f} s ({span(walls)}) | "
            f"{' / '.join(f'{w:.1f}' for w in per_node)} s | "
            f"{statistics.median(tx):.2f}x ({span(tx, '{:.2f}')}) | {store:.2f}x | {peer:.2f}x |"
        )
    every = statistics.median(r["wall"] for r in out[EVERY])
    shared = statistics.median(r["wall"] for r in out[SHARED])
    multiple = statistics.median(r["store_tx"] / size for r in out[SHARED])
    return "\n".join(rows), every / shared, multiple


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=2048, help="checkpoint size (MiB)")
    parser.add_argument("--shards", type=int, default=16, help="DCP shards (plus .metadata)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--node-mbit", type=float, default=2000.0, help="each node's link")
    parser.add_argument(
        "--store-mbit", type=float, default=None, help="the store's link (a quarter of a node's)"
    )
    parser.add_argument("--smoke", action="store_true", help="64 MiB, one round")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--log-dir", default=None, help="keep the restores' stderr here")
    parser.add_argument(
        "--restore-dir",
        default=None,
        help="restore the nodes' trees under this directory (e.g. /dev/shm: a disk per "
        "node, where the default puts all four on this machine's one disk)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.rounds = 64, 1
    if args.store_mbit is None:
        args.store_mbit = args.node_mbit / 4
    print(machine_line(), flush=True)
    print(
        f"{args.mib} MiB checkpoint ({args.shards} shards + .metadata), {NODES} nodes, "
        f"node links {args.node_mbit:g} Mbit/s, store link {args.store_mbit:g} Mbit/s "
        f"(both ways), {args.rounds} round(s), the nodes' trees restored under "
        f"{args.restore_dir or 'the work directory (this machine has one disk)'}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-cluster-restore-") as tmp:
        logs = Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"
        result = measure(Path(tmp) / "work", args, logs)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    links = ", ".join(f"{k} {v:.0f}" for k, v in result["links_mbit"].items())
    print(
        f"\n{result['committed_bytes'] / MIB:.0f} MiB checkpoint, {NODES} nodes; links "
        f"(Mbit/s) nodes {args.node_mbit:g}, store {args.store_mbit:g}; measured (one flow): "
        f"{links}; {args.rounds} round(s); load average {load} at the end\n"
    )
    text, speedup, multiple = table(result)
    print(text)
    met_speed = speedup >= GOAL_SPEEDUP
    met_bytes = multiple <= GOAL_STORE_MULTIPLE
    print(
        f"\nshared restore {speedup:.2f}x faster than every node from the store "
        f"(goal >= {GOAL_SPEEDUP:g}x: {'met' if met_speed else 'NOT met'}); "
        f"{multiple:.2f}x the checkpoint's bytes out of the store "
        f"(goal <= {GOAL_STORE_MULTIPLE:g}x: {'met' if met_bytes else 'NOT met'})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    **result,
                    "speedup": speedup,
                    "shared_store_multiple": multiple,
                    "goals_met": {"speedup": met_speed, "store_bytes": met_bytes},
                },
                indent=2,
            )
        )
    return 0 if (met_speed and met_bytes) or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
