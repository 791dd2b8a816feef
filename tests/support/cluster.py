"""Several "nodes" on one machine: real processes, own directories, one store.

Node ``k`` of a cluster is ``<work>/node-k/`` holding ``run/`` (its local checkpoint root,
the dir its daemon watches) and ``state/`` (its daemon's journal). Each node has its own
``ckptd run`` with ``[cluster] nodes = N, node_rank = k``, its own HTTP port and state dir;
all write to one destination (the SeaweedFS fixture) under one run id. The trainer is
:mod:`tests.support.trainers.cluster_dcp`: ``ranks_per_node`` processes per node over gloo, as
torchrun would start them, each saving into its own node's ``run/``.

:class:`Store` reads what the daemons wrote, and :func:`check_committed` is the one check
every multi-node test ends with: a committed checkpoint lists exactly the files the nodes
hold, and every object reads back byte-identical with the manifest's CRC-32C.

Shared by ``tests/e2e/test_cluster*.py`` and ``bench/bench_cluster.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.core.checksum import crc32c, to_hex
from ckptd.devtools.locals3 import free_port
from tests.support.daemon import Daemon, wait_until
from tests.support.trainers.procs import script_env

RUN_ID = "run"
MANIFEST = "ckptd.manifest.json"
ANNOUNCEMENT = "ckptd.announce.json"
TRAINER_MODULE = "tests.support.trainers.cluster_dcp"


def part_key(rank: int) -> str:
    return f"ckptd.part-{rank}.json"


@dataclass
class Node:
    """One node: its directories and (once built) its daemon."""

    rank: int
    root: Path
    daemon: Daemon | None = None

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def checkpoint(self, name: str) -> Path:
        return self.run_dir / name

    def local_files(self, name: str) -> dict[str, Path]:
        """Relative path -> file, for this node's files of checkpoint ``name``."""
        base = self.checkpoint(name)
        if not base.is_dir():
            return {}
        return {
            p.relative_to(base).as_posix(): p
            for p in sorted(base.rglob("*"))
            if p.is_file() and not p.name.endswith(".tmp")
        }


def node_config_text(
    *,
    nodes: int,
    rank: int,
    poll_interval: float,
    imds_url: str | None = None,
    trainer_match: str | None = None,
) -> str:
    """What a cluster node's config adds to :func:`tests.support.daemon.write_config`'s."""
    text = (
        f"[cluster]\nnodes = {nodes}\nnode_rank = {rank}\n"
        f"poll_interval_seconds = {poll_interval}\n"
        # Retention off: a test checks every checkpoint it ever committed.
        "[retention]\nkeep_last = 0\n"
    )
    if trainer_match is not None:
        text += f"[trainer]\nmatch = {json.dumps(trainer_match)}\n"
    if imds_url is not None:
        text += (
            f'[preemption]\nprovider = "aws"\nendpoint = {json.dumps(imds_url)}\n'
            "poll_interval_seconds = 0.2\n"
        )
    return text


@dataclass
class Cluster:
    """N nodes under ``work``, each with its own daemon process (not started yet)."""

    work: Path
    nodes: int
    dest: str
    endpoint_url: str
    settle_seconds: float = 0.2
    poll_interval: float = 0.2
    layout: str = "auto"
    destination: dict[str, Any] = field(default_factory=dict)
    imds_urls: dict[int, str] = field(default_factory=dict)  # node rank -> fake IMDS
    trainer_match: bool = False  # daemons signal their node's trainer ranks
    members: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        for rank in range(self.nodes):
            node = Node(rank, self.work / f"node-{rank}")
            node.run_dir.mkdir(parents=True, exist_ok=True)
            node.daemon = self._daemon(node)
            self.members.append(node)

    def _daemon(self, node: Node) -> Daemon:
        daemon = Daemon.configured(
            node.root,
            name="ckptd",
            watch=[
                {
                    "dir": node.run_dir,
                    "run_id": RUN_ID,
                    "layout": self.layout,
                    "settle_seconds": self.settle_seconds,
                    "rescan_seconds": 2.0,
                }
            ],
            dest=self.dest,
            endpoint_url=self.endpoint_url,
            state_dir=node.state_dir,
            **self.destination,
        )
        text = daemon.config.read_text()
        imds = self.imds_urls.get(node.rank)
        if imds is not None:
            text = text.replace('[preemption]\nprovider = "none"\n', "")
        daemon.config.write_text(
            text
            + node_config_text(
                nodes=self.nodes,
                rank=node.rank,
                poll_interval=self.poll_interval,
                imds_url=imds,
                trainer_match=trainer_match(node.run_dir) if self.trainer_match else None,
            )
        )
        return daemon

    def __getitem__(self, rank: int) -> Node:
        return self.members[rank]

    def daemon(self, rank: int) -> Daemon:
        daemon = self.members[rank].daemon
        assert daemon is not None
        return daemon

    def start(self, *ranks: int) -> Cluster:
        for rank in ranks or range(self.nodes):
            self.daemon(rank).start()
        return self

    def alive(self, rank: int) -> bool:
        return self.daemon(rank).alive()

    def stop(self, *ranks: int) -> None:
        for rank in ranks or range(self.nodes):
            if self.daemon(rank).alive():
                self.daemon(rank).stop()

    def kill9(self, *ranks: int) -> None:
        for rank in ranks or range(self.nodes):
            if self.daemon(rank).alive():
                self.daemon(rank).kill9()

    def close(self) -> None:
        """Kill whatever still runs (each daemon by its own PID)."""
        for node in self.members:
            if node.daemon is not None and node.daemon.alive():
                node.daemon.kill9()

    def logs(self) -> str:
        return "\n".join(
            f"--- node {n.rank} ---\n{n.daemon.log_text()[-3000:]}"
            for n in self.members
            if n.daemon is not None
        )

    def local_files(self, name: str) -> dict[int, dict[str, Path]]:
        return {n.rank: n.local_files(name) for n in self.members}

    def wipe(self) -> None:
        """The nodes are gone and their disks with them (daemons must be dead)."""
        for node in self.members:
            assert node.daemon is None or not node.daemon.alive()
            shutil.rmtree(node.root)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def trainer_match(run_dir: Path) -> str:
    """The command-line substring that names one node's trainer ranks (and no other's)."""
    return f"--node-dir {run_dir} "


# -- the store -----------------------------------------------------------------------------


class Store:
    """Read-only view of one run under ``prefix`` in the test bucket (boto3 client)."""

    def __init__(self, s3: Any, prefix: str, run: str = RUN_ID, bucket: str = "ckpt") -> None:
        self.s3 = s3
        self.prefix = prefix
        self.run = run
        self.bucket = bucket

    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, self.run, *parts])

    def keys(self, under: str = "") -> list[str]:
        """Every key under the run (or under ``run/under``), relative to the run."""
        base = self.key(under) if under else self.key("")
        base = base.rstrip("/") + "/"
        out: list[str] = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base
        ):
            out += [o["Key"][len(self.key("")) :].lstrip("/") for o in page.get("Contents", [])]
        return out

    def get(self, *parts: str) -> bytes | None:
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self.key(*parts))
        except self.s3.exceptions.NoSuchKey:
            return None
        data: bytes = body["Body"].read()
        return data

    def json(self, *parts: str) -> dict[str, Any] | None:
        data = self.get(*parts)
        return None if data is None else dict(json.loads(data))

    def manifest(self, name: str) -> dict[str, Any] | None:
        return self.json(name, MANIFEST)

    def part(self, name: str, rank: int) -> dict[str, Any] | None:
        return self.json(name, part_key(rank))

    def announcement(self, name: str) -> dict[str, Any] | None:
        return self.json(name, ANNOUNCEMENT)

    def committed(self) -> list[str]:
        """Names of the committed checkpoints (those with a global manifest)."""
        return sorted(
            k.split("/")[0] for k in self.keys() if k.count("/") == 1 and k.endswith(MANIFEST)
        )

    def latest(self) -> dict[str, Any] | None:
        return self.json("LATEST")


def check_committed(
    store: Store, name: str, files: dict[int, dict[str, Path]], *, nodes: int
) -> dict[str, Any]:
    """Assert ``name`` is committed with every file of every node, byte-identical.

    ``files`` maps node rank -> relative path -> local file (:meth:`Cluster.local_files`,
    or the contents of a save the test wrote). Every object is read back and its CRC-32C
    compared with the manifest's. Returns the manifest.
    """
    manifest = store.manifest(name)
    assert manifest is not None, f"{name} is not committed"
    assert manifest.get("nodes") == nodes, f"{name}: manifest nodes {manifest.get('nodes')}"
    expected: dict[str, Path] = {}
    for rank in sorted(files):
        for rel, path in files[rank].items():
            if rel in expected:  # the same path on two nodes must hold the same bytes
                assert expected[rel].read_bytes() == path.read_bytes(), rel
            expected[rel] = path
    listed = {f["path"]: f for f in manifest["files"]}
    assert len(listed) == len(manifest["files"]), f"{name}: a path is listed twice"
    assert set(listed) == set(expected), (
        f"{name}: manifest lists {sorted(listed)}, the nodes hold {sorted(expected)}"
    )
    for rel, local in expected.items():
        remote = store.get(name, rel)
        assert remote is not None, f"{name}/{rel} is missing from the store"
        assert remote == local.read_bytes(), f"{name}/{rel} differs from node's file"
        assert listed[rel]["size"] == len(remote), rel
        assert listed[rel]["crc32c"] == to_hex(crc32c(remote)), f"{name}/{rel}: CRC-32C"
    assert manifest["total_bytes"] == sum(f["size"] for f in manifest["files"])
    return manifest


def snapshot(files: dict[int, dict[str, Path]], into: Path) -> dict[int, dict[str, Path]]:
    """Copy one save's files aside (the nodes may overwrite them) and return the copies."""
    out: dict[int, dict[str, Path]] = {}
    for rank, by_path in files.items():
        out[rank] = {}
        for rel, path in by_path.items():
            target = into / f"node-{rank}" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            out[rank][rel] = target
    return out


def restore_latest(
    dest: str, endpoint_url: str, to: Path, work: Path, *, checkpoint: str | None = None
) -> str:
    """``ckptd restore --latest`` (or ``--checkpoint NAME``; the whole checkpoint) on a
    fresh node; the name restored."""
    config = work / "restore.toml"
    work.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"[destination]\nurl = {json.dumps(dest)}\nendpoint_url = {json.dumps(endpoint_url)}\n"
        f"[state]\ndir = {json.dumps(str(work / 'restore-state'))}\n"
    )
    done = subprocess.run(
        [
            *(sys.executable, "-m", "ckptd", "restore", "--run", RUN_ID),
            *(["--checkpoint", checkpoint] if checkpoint else ["--latest"]),
            *("--to", str(to), "--json", "--config", str(config)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return str(json.loads(done.stdout)["checkpoint"])


# -- the trainer ---------------------------------------------------------------------------


class TrainerGroup:
    """``nodes * ranks_per_node`` ranks of the cluster trainer, one process each, as
    torchrun would start them (each ended by its own PID)."""

    def __init__(
        self,
        out: Path,
        run_dirs: list[Path],
        args: list[str],
        *,
        module: str = TRAINER_MODULE,
        resume: list[Path] | None = None,
        ranks_per_node: int = 2,
    ) -> None:
        self.out = out
        self.final = out / "final.pt"
        out.mkdir(parents=True, exist_ok=True)
        world = len(run_dirs) * ranks_per_node
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.started_wall = time.time()
        for rank in range(world):
            node = rank // ranks_per_node
            argv = [sys.executable, "-m", module, "--node-dir", str(run_dirs[node])]
            argv += ["--out", str(out), *args]
            if resume is not None:
                argv += ["--resume", str(resume[node])]
            env = script_env(
                out,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank % ranks_per_node),
                LOCAL_WORLD_SIZE=str(ranks_per_node),
                NODE_RANK=str(node),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            log = out / f"rank-{rank}.log"
            self.logs.append(log)
            with log.open("wb") as fh:
                self.procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        cwd=out,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )

    def log_tail(self) -> str:
        return "\n".join(
            f"--- rank {i} ---\n{p.read_text(errors='replace')[-2000:]}"
            for i, p in enumerate(self.logs)
        )

    def progress(self) -> Iterator[dict[str, Any] | None]:
        for rank in range(len(self.procs)):
            try:
                yield dict(json.loads((self.out / f"progress-{rank}.json").read_text()))
            except (OSError, ValueError):
                yield None

    def step(self) -> int:
        """The step every rank has finished (-1 before each has finished one)."""
        return min((p["step"] if p else -1) for p in self.progress())

    def resumed_from(self) -> set[int]:
        return {p["resumed_from"] for p in self.progress() if p}

    def wait_step(self, at_least: int, timeout: float) -> int:
        def reached() -> int | None:
            for p in self.procs:
                if p.poll() is not None and p.returncode != 0:
                    raise AssertionError(f"a rank exited {p.returncode}:\n{self.log_tail()}")
            step = self.step()
            return step if step >= at_least else None

        return int(wait_until(reached, timeout, f"every rank at step {at_least}", 0.02))

    def wait_exit(self, timeout: float) -> list[dict[str, Any]]:
        """Wait for every rank to exit 0; their result documents."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"ranks still running:\n{self.log_tail()}") from None
            assert code == 0, f"a rank exited {code}:\n{self.log_tail()}"
        return [
            dict(json.loads((self.out / f"result-{r}.json").read_text()))
            for r in range(len(self.procs))
        ]

    def kill9(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=10)


def dcp_trainer(
    out: Path,
    run_dirs: list[Path],
    *,
    max_steps: int,
    save_every: int,
    resume: list[Path] | None = None,
    hang_at: int = 0,
    step_delay: float = 0.0,
    ballast_mib: int = 0,
) -> TrainerGroup:
    """The FSDP2/DCP trainer (:mod:`tests.support.trainers.cluster_dcp`) on every node."""
    args = ["--final", str(out / "final.pt"), "--max-steps", str(max_steps)]
    args += ["--save-every", str(save_every), "--hang-at", str(hang_at)]
    args += ["--step-delay", str(step_delay), "--ballast-mib", str(ballast_mib)]
    return TrainerGroup(out, run_dirs, args, resume=resume)


def compare_weights(reference: Path, resumed: Path) -> list[str]:
    """Names of the tensors that are not bit-identical (empty: all equal)."""
    import torch

    a = torch.load(reference, weights_only=True)
    b = torch.load(resumed, weights_only=True)
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
