"""What many nodes cost: from the commit record appearing to the global commit.

```sh
.venv/bin/python bench/bench_cluster.py            # 1, 2, 4 nodes; 5 trials (~4 min on 2 cores)
.venv/bin/python bench/bench_cluster.py --quick    # 3 trials, smaller checkpoint (~1.5 min)
.venv/bin/python bench/bench_cluster.py --json bench/results/cluster.json
```

One loopback SeaweedFS (``ckptd.devtools.locals3``); for each node count N, N ``ckptd run``
processes (``[cluster] nodes = N, node_rank = k``, each its own watch dir, state dir and
port; N = 1 is a plain single-node daemon), default ``settle_seconds`` and
``poll_interval_seconds`` unless given. A trial writes one DCP-shaped checkpoint as
``FileSystemWriter`` leaves it on node-local disks: the nodes k > 0 write their shards,
then node 0 writes its shards and renames ``.metadata.tmp`` to ``.metadata`` (the commit
record). The same total bytes are split evenly over the nodes, so N = 1 is the single node
shipping the same checkpoint. Timed from the rename (the bench's clock) to each daemon's
log events (same machine, same clock): ``checkpoint_announced`` (node 0),
the last ``part_written``, and the first ``checkpoint_committed`` (the global manifest).

Read the "added" column with the machine in mind: here all N "nodes" share two cores,
one disk and one loopback store, so N nodes ship no faster than one; on real nodes each
ships its own share in parallel. What the column shows is the protocol's price: the
announcement, the followers' poll for it, part manifests, the listing and merge.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common

from common import BUCKET, MIB, event_time, log_events, machine_line

from ckptd.devtools.locals3 import LocalS3, free_port

SHARD = 4 * MIB


@dataclass
class Node:
    rank: int
    root: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "ckptd.log"


@dataclass
class Trial:
    nodes: int
    total_bytes: int
    announced_s: float | None
    parts_s: float | None
    committed_s: float


@dataclass
class Row:
    nodes: int
    total_bytes: int
    trials: list[Trial] = field(default_factory=list)

    def median(self, attr: str) -> float | None:
        values = [getattr(t, attr) for t in self.trials if getattr(t, attr) is not None]
        return statistics.median(values) if values else None

    def spread(self, attr: str) -> str:
        values = [getattr(t, attr) for t in self.trials if getattr(t, attr) is not None]
        return f"{min(values):.2f}-{max(values):.2f}" if values else "—"


def write_config(
    node: Node, nodes: int, dest: str, endpoint: str, settle: float, poll: float
) -> Path:
    lines = [
        "[[watch]]",
        f"dir = {json.dumps(str(node.run_dir))}",
        'run_id = "run"',
        'layout = "dcp"',
        f"settle_seconds = {settle}",
        "[destination]",
        f"url = {json.dumps(dest)}",
        f"endpoint_url = {json.dumps(endpoint)}",
        "[retention]",
        "keep_last = 0",
        "[preemption]",
        'provider = "none"',
        "[metrics]",
        f'listen = "127.0.0.1:{node.port}"',
        "[state]",
        f"dir = {json.dumps(str(node.root / 'state'))}",
    ]
    if nodes > 1:
        lines += ["[cluster]", f"nodes = {nodes}", f"node_rank = {node.rank}"]
        lines += [f"poll_interval_seconds = {poll}"]
    path = node.root / "ckptd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start(node: Node, config: Path, env: dict[str, str]) -> None:
    with node.log.open("ab") as log:
        node.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "run", "--config", str(config)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/healthz", timeout=1):
                return
        except OSError as exc:
            if node.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"ckptd on node {node.rank} did not start:\n{node.log.read_text()}"
                ) from exc
            time.sleep(0.1)


def write_shards(directory: Path, ranks: range, size: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        with open(directory / f"__{rank}_0.distcp", "wb") as fh:
            fh.write(os.urandom(size))
            fh.flush()
            os.fsync(fh.fileno())


def write_checkpoint(nodes: list[Node], name: str, total_bytes: int) -> float:
    """Every node's shards, node 0's last, then node 0's ``.metadata``; the rename's time."""
    per_node = max(1, total_bytes // len(nodes))
    shards = max(1, per_node // SHARD)
    for node in reversed(nodes):
        first = node.rank * shards
        write_shards(node.run_dir / name, range(first, first + shards), per_node // shards)
    directory = nodes[0].run_dir / name
    (directory / ".metadata.tmp").write_bytes(os.urandom(4096))
    os.replace(directory / ".metadata.tmp", directory / ".metadata")
    return time.time()


def committed(s3: Any, prefix: str, name: str) -> bool:
    try:
        s3.head_object(Bucket=BUCKET, Key=f"{prefix}/run/{name}/ckptd.manifest.json")
    except s3.exceptions.ClientError:
        return False
    return True


def first_event(nodes: list[Node], event: str, name: str, *, last: bool = False) -> float | None:
    times = [
        event_time(e)
        for n in nodes
        for e in log_events(n.log)
        if e.get("event") == event and e.get("checkpoint") == name
    ]
    if not times:
        return None
    return max(times) if last else min(times)


def measure(
    server: LocalS3,
    s3: Any,
    work: Path,
    count: int,
    total_bytes: int,
    trials: int,
    settle: float,
    poll: float,
) -> Row:
    prefix = f"bench-cluster-{uuid.uuid4().hex[:8]}"
    dest = f"s3://{BUCKET}/{prefix}"
    env = {**os.environ, **server.env(), "PYTHONUNBUFFERED": "1"}
    nodes = [
        Node(k, work / f"n{count}-{total_bytes}" / f"node-{k}", free_port()) for k in range(count)
    ]
    row = Row(count, total_bytes)
    try:
        for node in nodes:
            node.run_dir.mkdir(parents=True)
            start(node, write_config(node, count, dest, server.endpoint_url, settle, poll), env)
        for trial in range(trials):
            name = f"step-{trial + 1}"
            t0 = write_checkpoint(nodes, name, total_bytes)
            deadline = time.monotonic() + 120
            while not committed(s3, prefix, name):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} on {count} nodes not committed in 120 s")
                time.sleep(0.02)
            # The committing daemon logs just after the conditional write; let it land.
            wait = time.monotonic() + 5
            while first_event(nodes, "checkpoint_committed", name) is None:
                if time.monotonic() > wait:
                    break
                time.sleep(0.02)
            done = first_event(nodes, "checkpoint_committed", name)
            assert done is not None, f"no checkpoint_committed event for {name}"
            announced = first_event(nodes, "checkpoint_announced", name)
            parts = first_event(nodes, "part_written", name, last=True)
            row.trials.append(
                Trial(
                    count,
                    total_bytes,
                    None if announced is None else announced - t0,
                    None if parts is None else parts - t0,
                    done - t0,
                )
            )
            print(
                f"  {count} node(s), {total_bytes / MIB:.1f} MiB, {name}: committed "
                f"{done - t0:.2f} s after the record",
                flush=True,
            )
    finally:
        for node in nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
                try:
                    node.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait()
    return row


def size_label(total: int) -> str:
    return "tiny (12 KiB)" if total < MIB else f"{total // MIB} MiB"


def markdown(rows: list[Row], settle: float, poll: float, trials: int) -> str:
    lines = [
        f"Machine: {machine_line()}.",
        f"`settle_seconds = {settle}`, `poll_interval_seconds = {poll}`; median of {trials} "
        "trials (min-max), seconds from node 0's `.metadata` rename.",
        "",
        "| nodes | checkpoint | → announced | → last part | → committed (min-max) "
        "| added vs 1 node |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    single = {r.total_bytes: r.median("committed_s") for r in rows if r.nodes == 1}
    for r in rows:
        base = single.get(r.total_bytes)
        med = r.median("committed_s")
        added = "—" if r.nodes == 1 or base is None or med is None else f"{med - base:+.2f}"
        ann = r.median("announced_s")
        parts = r.median("parts_s")
        lines.append(
            f"| {r.nodes} | {size_label(r.total_bytes)} "
            f"| {'—' if ann is None else f'{ann:.2f}'} "
            f"| {'—' if parts is None else f'{parts:.2f}'} "
            f"| {med:.2f} ({r.spread('committed_s')}) | {added} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 trials, 16 MiB checkpoints")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--nodes", default="1,2,4", help="node counts, comma-separated")
    p.add_argument("--settle", type=float, default=2.0, help="settle_seconds (default 2.0)")
    p.add_argument("--poll", type=float, default=1.0, help="poll_interval_seconds (default 1.0)")
    p.add_argument("--json", type=Path, default=None, help="also write the trials here")
    args = p.parse_args()
    trials = args.trials or (3 if args.quick else 5)
    sizes = [12 * 1024, (16 if args.quick else 64) * MIB]
    counts = [int(c) for c in args.nodes.split(",")]

    import boto3

    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-cluster-"))
    server = LocalS3(work / "seaweedfs").start()
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            **{
                "aws_access_key_id": server.env()["AWS_ACCESS_KEY_ID"],
                "aws_secret_access_key": server.env()["AWS_SECRET_ACCESS_KEY"],
                "region_name": "us-east-1",
            },
        )
        rows = [
            measure(server, s3, work, count, size, trials, args.settle, args.poll)
            for size in sizes
            for count in counts
        ]
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(markdown(rows, args.settle, args.poll, trials))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                [
                    {
                        "nodes": t.nodes,
                        "total_bytes": t.total_bytes,
                        "announced_s": t.announced_s,
                        "parts_s": t.parts_s,
                        "committed_s": t.committed_s,
                    }
                    for r in rows
                    for t in r.trials
                ],
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
