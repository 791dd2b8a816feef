"""Part 5 of ``bench_scale.py``: N daemons (separate processes) against one store.

Each daemon is a plain ``ckptd run`` with ``[cluster] nodes = N, node_rank = k`` (own
watch dir, state dir, port; default ``poll_interval_seconds``; DCP layout), all behind
one fault proxy in front of one SeaweedFS, which counts every request. Measured per N:

- memory: each daemon's RSS once all are ready (median and largest);
- idle: requests over ``idle_seconds`` with nothing to ship, per node per minute, by kind;
- one sharded checkpoint (a 64 KiB shard per node, node 0's ``.metadata`` last, as
  ``bench_cluster.py`` writes it): the last ``part_written`` → the global
  ``checkpoint_committed``, the commit record → commit, and the requests from the record
  to the commit (idle polling included).

Then what the idle rate costs on AWS S3 for a 1,000-node fleet, and its headroom under
S3's per-prefix request rates. Here all N daemons share the machine's cores.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _scale_run import rss_mib
from bench_cluster import Node, first_event, write_checkpoint, write_config
from common import BUCKET

from ckptd.devtools.locals3 import LocalS3, free_port

# AWS S3 Standard, us-east-1, published request prices (USD per 1,000 requests).
GET_PRICE = 0.0004  # GET, HEAD and other reads
PUT_PRICE = 0.005  # PUT, COPY, POST, LIST
FLEET = 1000
PREFIX_READS = 5500  # per second per prefix
PREFIX_WRITES = 3500


@dataclass
class FleetRow:
    nodes: int
    start_s: float
    rss: list[float]
    idle_seconds: float
    idle: Counter[str] = field(default_factory=Counter)
    last_part_to_commit_s: float | None = None
    record_to_commit_s: float | None = None
    commit_requests: int = 0
    commit_notice_gets: int = 0  # of them, the NOTICE polling that went on meanwhile

    def idle_per_node_minute(self, kind: str | None = None) -> float:
        count = sum(self.idle.values()) if kind is None else self.idle[kind]
        return count / self.nodes / (self.idle_seconds / 60)


def kind_of(method: str, path: str, query: str) -> str:
    if "list-type" in query:
        return "LIST"
    if path.endswith("/NOTICE"):
        return f"{method} NOTICE"
    return method


def start_all(nodes: list[Node], configs: list[Path], env: dict[str, str]) -> float:
    t0 = time.monotonic()
    for node, cfg in zip(nodes, configs, strict=True):
        with node.log.open("ab") as log:
            node.proc = subprocess.Popen(
                [sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
            )
    waiting = list(nodes)
    deadline = time.monotonic() + 60 + 10 * len(nodes)
    while waiting:
        node = waiting[0]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/healthz", timeout=2):
                waiting.pop(0)
                continue
        except OSError as exc:
            assert node.proc is not None
            if node.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"node {node.rank} did not start:\n{node.log.read_text()}"
                ) from exc
        time.sleep(0.2)
    return time.monotonic() - t0


def stop_all(nodes: list[Node]) -> None:
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.terminate()
    for node in nodes:
        if node.proc is None:
            continue
        try:
            node.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()


def measure_fleet(
    work: Path, server: LocalS3, count: int, idle_seconds: float, say: Callable[[str], None]
) -> FleetRow:
    import boto3

    from tests.support.faultproxy import FaultProxy

    s3 = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
    prefix = f"fleet-{count}-{int(time.time())}"
    env = {**os.environ, **server.env(), "PYTHONUNBUFFERED": "1"}
    nodes = [Node(k, work / prefix / f"node-{k}", free_port()) for k in range(count)]
    with FaultProxy(server.endpoint_url) as proxy:
        configs = []
        for node in nodes:
            node.run_dir.mkdir(parents=True)
            dest = f"s3://{BUCKET}/{prefix}"
            configs.append(write_config(node, count, dest, proxy.url, 2.0, 1.0))
        try:
            started = start_all(nodes, configs, env)
            say(f"{count} daemons ready in {started:.0f} s")
            time.sleep(5)  # past every daemon's start-up requests
            row = FleetRow(count, started, [rss_mib(n.proc.pid) for n in nodes if n.proc], 0.0)
            proxy.reset_counters()
            t0 = time.monotonic()
            time.sleep(idle_seconds)
            row.idle_seconds = time.monotonic() - t0
            row.idle.update(kind_of(r.method, r.path, r.query) for r in proxy.requests)
            say(f"{count} idle: {dict(row.idle)} in {row.idle_seconds:.0f} s")
            proxy.reset_counters()
            commit_once(row, nodes, s3, prefix)
            kinds = Counter(kind_of(r.method, r.path, r.query) for r in proxy.requests)
            row.commit_requests = sum(kinds.values())
            row.commit_notice_gets = kinds["GET NOTICE"]
            say(f"{count} commit: {row}")
        finally:
            stop_all(nodes)
    return row


def commit_once(row: FleetRow, nodes: list[Node], s3: Any, prefix: str) -> None:
    name = "step-1"
    t0 = write_checkpoint(nodes, name, 64 * 1024 * len(nodes))
    deadline = time.monotonic() + 120 + 5 * len(nodes)
    key = f"{prefix}/run/{name}/ckptd.manifest.json"
    while True:
        try:
            s3.head_object(Bucket=BUCKET, Key=key)
            break
        except s3.exceptions.ClientError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} on {len(nodes)} nodes not committed") from None
            time.sleep(0.05)
    done = None
    wait = time.monotonic() + 10
    while done is None and time.monotonic() < wait:
        done = first_event(nodes, "checkpoint_committed", name)
        time.sleep(0.1)
    last_part = first_event(nodes, "part_written", name, last=True)
    if done is not None:
        row.record_to_commit_s = done - t0
        if last_part is not None:
            row.last_part_to_commit_s = done - last_part


def fleet_tables(rows: list[FleetRow]) -> list[str]:
    out = [
        "| daemons | all ready s | RSS per daemon MiB (median / max) | idle requests per "
        "node per minute (NOTICE GETs / other) | last part → global commit s | commit "
        "record → global commit s | requests, record → commit, NOTICE polls left out "
        "(per node) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        notice = r.idle_per_node_minute("GET NOTICE")
        other = r.idle_per_node_minute() - notice
        last = "-" if r.last_part_to_commit_s is None else f"{r.last_part_to_commit_s:.2f}"
        rec = "-" if r.record_to_commit_s is None else f"{r.record_to_commit_s:.2f}"
        commit = r.commit_requests - r.commit_notice_gets
        out.append(
            f"| {r.nodes} | {r.start_s:.0f} | {statistics.median(r.rss):.0f} / {max(r.rss):.0f} "
            f"| {notice:.1f} / {other:.1f} | {last} | {rec} | {commit} "
            f"({commit / r.nodes:.1f}) |"
        )
    if rows:
        out += ["", *cost_lines(rows[-1])]
    return out


def cost_lines(row: FleetRow) -> list[str]:
    reads = sum(n for k, n in row.idle.items() if k.startswith(("GET", "HEAD")))
    writes = sum(row.idle.values()) - reads
    per_node_day_reads = reads / row.nodes / row.idle_seconds * 86400
    per_node_day_writes = writes / row.nodes / row.idle_seconds * 86400
    usd = FLEET * (per_node_day_reads * GET_PRICE + per_node_day_writes * PUT_PRICE) / 1000
    read_rate = FLEET * reads / row.nodes / row.idle_seconds
    return [
        f"Idle, a {FLEET:,}-node fleet at the rate measured with {row.nodes} daemons: "
        f"{FLEET * per_node_day_reads:,.0f} reads and {FLEET * per_node_day_writes:,.0f} "
        f"writes/lists a day, **${usd:,.2f} a day** at S3 Standard's ${GET_PRICE}/1,000 GET "
        f"and ${PUT_PRICE}/1,000 PUT/LIST; {read_rate:,.0f} reads/s on the run's prefix, "
        f"{read_rate / PREFIX_READS:.0%} of S3's {PREFIX_READS:,} per prefix "
        f"({PREFIX_WRITES:,} writes)."
    ]
