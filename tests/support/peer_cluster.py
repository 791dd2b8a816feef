"""A cluster with peer replication on the namespace rig: nodes, a store, shaped links.

``PeerRig`` is the network (``tests.support.netns.Rig``) with a SeaweedFS in a namespace
of its own, behind a link slower than the nodes' (the store is the bottleneck peers get
around). ``PeerNode`` is one node: a host of the rig, its directories (``run/`` watched,
``state/``), its config (``[cluster]``, ``[peers]`` with the cluster's token, the store at
the store host's address) and its ``ckptd run`` inside its namespace. The test process
sits on the bridge: it reads the store with boto3 at the store's address, and asks a
daemon over its control socket (``ckptd status``, ``ckptd drill``) or its metrics port.

Shared by tests/e2e/test_peers_*.py and bench/bench_peers.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY, LocalS3, free_port, s3_client
from tests.support.cluster import trainer_match
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.netns import Host, Rig, Shape, rig_or_skip

RUN_ID = "run"
BUCKET = "ckpt"
TOKEN = "0123456789abcdef0123456789abcdef"
PEER_PORT = 9465
S3_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class PeerNode:
    """One node of the cluster (module doc)."""

    rank: int
    host: Host
    root: Path
    config: Path
    daemon: Daemon

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def replicas(self) -> Path:
        return self.root / "replicas"

    @property
    def address(self) -> str:
        return f"{self.host.address}:{PEER_PORT}"

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``ckptd ARGS --config <this node's>`` from the test process (the control
        socket is a file: reached from outside the namespace)."""
        return run_cli(*args, config=self.config, timeout=timeout)

    def status(self) -> dict[str, Any]:
        done = self.cli("status", "--json", timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
        return dict(json.loads(done.stdout))

    def restore_cli(self, to: Path, *extra: str, timeout: float = 180) -> dict[str, Any]:
        """``ckptd restore --latest --to DIR --json`` run *inside* this node's namespace."""
        argv = [
            *self.host.argv([sys.executable, "-m", "ckptd", "restore", "--run", RUN_ID]),
            *("--latest", "--to", str(to), "--json", "--no-progress", "--config", str(self.config)),
            *extra,
        ]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **S3_ENV}
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return dict(json.loads(done.stdout))


@dataclass
class PeerRig:
    """The rig, its store, and the nodes added so far (module doc)."""

    rig: Rig
    work: Path
    store_host: Host
    s3: LocalS3
    prefix: str
    nodes: list[PeerNode] = field(default_factory=list)

    @property
    def dest(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}"

    def ship_once(self, watch: Path, state: Path, timeout: float) -> None:
        """``ckptd run --once`` from the test host: every checkpoint in ``watch`` (run
        ``RUN_ID``, DCP) committed in the rig's store; RuntimeError with its stderr if not."""
        config = state.parent / "ckptd.toml"
        config.write_text(
            f'[[watch]]\ndir = "{watch}"\nrun_id = "{RUN_ID}"\nlayout = "dcp"\n'
            f'[destination]\nurl = "{self.dest}"\nendpoint_url = "{self.s3.endpoint_url}"\n'
            f'[state]\ndir = "{state}"\n[preemption]\nprovider = "none"\n'
        )
        done = subprocess.run(
            [sys.executable, "-m", "ckptd", "run", "--once", "--config", str(config)],
            capture_output=True,
            text=True,
            env={**os.environ, **S3_ENV},
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])

    def client(self) -> Any:
        return s3_client(self.s3.endpoint_url)

    def add_node(
        self,
        rank: int,
        *,
        nodes: int,
        shape: Shape,
        name: str | None = None,
        peers: dict[str, Any] | None = None,
        extra: str = "",
        start: bool = True,
        match_trainer: bool = False,
        destination: dict[str, Any] | None = None,
    ) -> PeerNode:
        """A new host and its daemon (``name`` defaults to ``node-<rank>``; a
        replacement gets a name, a host and an address of its own)."""
        name = name or f"node-{rank}"
        host = self.rig.add_host(name, shape)
        root = self.work / self.prefix / name
        (root / "run").mkdir(parents=True, exist_ok=True)
        token = self.work / "cluster.token"
        token.write_text(TOKEN + "\n")
        port = free_port()
        settings = {
            "enabled": True,
            "listen": f"{host.address}:{PEER_PORT}",
            "token_file": str(token),
            "quota_gib": 4,
            "dir": str(root / "replicas"),
            "handoff_after_seconds": 3,
            "restore_wait_seconds": 5,
            "announce_interval_seconds": 1,
            **(peers or {}),
        }
        config = root / "ckptd.toml"
        config.write_text(
            "[[watch]]\n"
            f"dir = {json.dumps(str(root / 'run'))}\nrun_id = {json.dumps(RUN_ID)}\n"
            'layout = "auto"\nsettle_seconds = 0.2\nrescan_seconds = 2.0\n'
            f"[destination]\nurl = {json.dumps(self.dest)}\n"
            f"endpoint_url = {json.dumps(self.s3.endpoint_url)}\n"
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in (destination or {}).items())
            + '[preemption]\nprovider = "none"\n'
            f'[metrics]\nlisten = "{host.address}:{port}"\n'
            f"[state]\ndir = {json.dumps(str(root / 'state'))}\n"
            f"[cluster]\nnodes = {nodes}\nnode_rank = {rank}\npoll_interval_seconds = 0.2\n"
            "[retention]\nkeep_last = 0\n"
            "[peers]\n"
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
            + (
                f"[trainer]\nmatch = {json.dumps(trainer_match(root / 'run'))}\n"
                if match_trainer
                else ""
            )
            + extra
        )
        daemon = Daemon(
            config,
            root / "ckptd.log",
            port,
            host=host.address,
            wrap=host.argv([]),
            env=dict(S3_ENV),
        )
        node = PeerNode(rank, host, root, config, daemon)
        self.nodes.append(node)
        if start:
            daemon.start()
        return node

    def kill(self, node: PeerNode) -> None:
        """The node vanishes: ``kill -9`` of its daemon, and its link down."""
        if node.daemon.alive():
            node.daemon.kill9()
        self.rig.link(node.host, up=False)

    def logs(self) -> str:
        return "\n".join(
            f"--- {n.host.name} ---\n{n.daemon.log_text()[-4000:]}" for n in self.nodes
        )

    def reset(self, prefix: str) -> None:
        """Every node gone (daemon killed, namespace deleted); a new prefix in the store:
        the next test starts from an empty cluster on the same store."""
        for node in self.nodes:
            if node.daemon.alive():
                node.daemon.kill9()
            self.rig.remove_host(node.host)
        self.nodes.clear()
        # The nodes' disks go with them (parts, replicas, restores: GiBs in a benchmark).
        shutil.rmtree(self.work / self.prefix, ignore_errors=True)
        self.prefix = prefix

    def close(self) -> None:
        for node in self.nodes:
            if node.daemon.alive():
                node.daemon.kill9()
        self.s3.stop()


@contextmanager
def peer_rig(work: Path, *, store: Shape, prefix: str = "peers") -> Iterator[PeerRig]:
    """A rig with its store up (module doc); everything gone afterwards."""
    with rig_or_skip() as rig:
        store_host = rig.add_host("store", store)
        s3 = LocalS3(
            work / "seaweedfs",
            buckets=(BUCKET,),
            ip=store_host.address,
            wrap=tuple(store_host.argv([])),
        )
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        s3.start(timeout=60)
        cluster = PeerRig(rig, work, store_host, s3, prefix)
        try:
            yield cluster
        finally:
            cluster.close()


def wait_for_peers(node: PeerNode, count: int, timeout: float = 30) -> None:
    """Until ``node`` knows ``count`` fresh peers (their announcements read)."""
    wait_until(
        lambda: len(node.status().get("peers", {}).get("known", [])) >= count,
        timeout,
        f"{node.host.name} to know {count} peers",
        interval=0.3,
        details=node.daemon.log_text,
    )


def read_store(rig: PeerRig, key: str) -> bytes | None:
    try:
        body = rig.client().get_object(Bucket=BUCKET, Key=f"{rig.prefix}/{RUN_ID}/{key}")
    except Exception:  # noqa: BLE001 - absent
        return None
    data: bytes = body["Body"].read()
    return data


def copy_tree(files: dict[str, Path], into: Path) -> dict[str, Path]:
    out = {}
    for rel, path in files.items():
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        out[rel] = target
    return out


def elapsed(since: float) -> float:
    return round(time.monotonic() - since, 3)
