"""The fleet campaign's cluster: node slots on the namespace rig, each slot's current host,
its cloud's metadata fake, and the job's processes on it.

A slot is one rank of the job (0 .. N-1). Its host is a namespace of
``tests.support.peer_cluster.PeerRig`` (the store, SeaweedFS, sits behind a slower link);
a replacement is a *new* host (new namespace, new address, new empty root directory) in the
same slot, with the same job spec. Each host has a fake of its cloud's metadata service
(tests/support/fakes), served from the campaign process on the rig's bridge address, which
that host's daemon polls (``[preemption] provider``/``endpoint``).

The invariant: every process the campaign starts on a host has that host's root directory
on its command line (config, node dir), so ``gone`` finds and SIGKILLs exactly them, by PID
(``ckptd exec`` puts its trainer in a session of its own: its process group is not enough),
and nothing outside the slot's root is ever touched.

A relaunch is a JobSet's restart: every pod is recreated, so each surviving host's
checkpoint dir (``run/``, the pod's emptyDir) starts empty, while ckptd's state and peer
replicas (``state/``, ``replicas/``: the host's, as ``/var/lib/ckptd`` under systemd or a
DaemonSet) stay. ``keep_disks`` keeps ``run/`` too (a hostPath): then ``ckptd exec`` on a
survivor finds its own part of the committed checkpoint there and refuses to restore the
rest (exit 1, "already exists and differs from the manifest"; see bench/README.md).

Two ways to run a rank (``Cluster.mode``):
- ``exec``: ``ckptd exec --config <node's> -- python -m tests.support.trainers.fleet_ddp``
  (the node's config: ``[cluster]``, ``[peers]`` on or off, the provider's fake);
- ``plain``: the trainer alone, resuming from ``CKPTD_RESUME_FROM`` when the launcher
  sets it (the uninterrupted run, and the sync-loop policy's blind restart).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.support.daemon import die_with_parent
from tests.support.fakes import FakeServer
from tests.support.fakes.aws_imds import FakeAwsImds
from tests.support.fakes.azure_metadata import FakeAzureMetadata
from tests.support.fakes.gcp_metadata import FakeGcpMetadata
from tests.support.netns import Host, Shape
from tests.support.peer_cluster import S3_ENV, PeerRig

REPO = Path(__file__).resolve().parent.parent
TRAINER = "tests.support.trainers.fleet_ddp"
PROVIDERS = ("aws", "gcp", "azure")


@dataclass(frozen=True)
class JobSpec:
    """What every start of the job runs (the same on a replacement)."""

    nodes: int
    steps: int
    save_every: int
    step_sleep: float
    hidden: int = 128
    layers: int = 3
    ballast_mib: int = 0
    seed: int = 0

    def trainer_args(self) -> list[str]:
        return [
            *("--steps", str(self.steps), "--save-every", str(self.save_every)),
            *("--step-sleep", str(self.step_sleep), "--hidden", str(self.hidden)),
            *("--layers", str(self.layers), "--ballast-mib", str(self.ballast_mib)),
            *("--seed", str(self.seed)),
        ]


def make_fake(provider: str) -> FakeServer:
    if provider == "aws":
        return FakeAwsImds()
    if provider == "gcp":
        return FakeGcpMetadata()
    if provider == "azure":
        return FakeAzureMetadata()
    raise ValueError(f"unknown provider {provider!r}")


def send_notice(fake: FakeServer, provider: str, window: float) -> None:
    """The provider's documented notice, ``window`` seconds ahead (GCP has no time field:
    its preempted flag means about 30 s)."""
    at = datetime.now(UTC) + timedelta(seconds=window)
    if isinstance(fake, FakeAwsImds):
        fake.trigger_spot("terminate", at=at)
    elif isinstance(fake, FakeGcpMetadata):
        fake.preempt()
    elif isinstance(fake, FakeAzureMetadata):
        fake.add_event("Preempt", not_before=at)
    else:
        raise ValueError(provider)


@dataclass
class Slot:
    """One rank's current host and what runs on it."""

    rank: int
    starts: int = 0  # trainer starts on this slot (the log's attempt)
    hosts: int = 0  # hosts this slot has had
    host: Host | None = None
    root: Path | None = None
    config: Path | None = None
    provider: str = "aws"
    fake: FakeServer | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def node_dir(self) -> Path:
        assert self.root is not None
        return self.root / "run"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Cluster:
    """The slots of one policy's run (module doc)."""

    prig: PeerRig
    out: Path
    job: JobSpec
    mode: str  # "exec" | "plain"
    peers: bool
    shape: Shape
    keep_disks: bool = False  # a relaunch keeps the survivors' checkpoint dirs
    slots: list[Slot] = field(default_factory=list)
    generation: int = 0

    def __post_init__(self) -> None:
        self.slots = [Slot(rank) for rank in range(self.job.nodes)]
        self.out.mkdir(parents=True, exist_ok=True)

    # -- hosts ---------------------------------------------------------------------------

    def bring_up(self, rank: int, provider: str) -> Slot:
        """A new host in slot ``rank``: empty root, its cloud's fake, its config."""
        slot = self.slots[rank]
        assert slot.host is None, f"slot {rank} has a host"
        slot.hosts += 1
        name = f"n{rank}h{slot.hosts}"
        fake = make_fake(provider)
        url = fake.start_in_thread(host=self.prig.rig.test_address)
        node = self.prig.add_node(
            rank,
            nodes=self.job.nodes,
            shape=self.shape,
            name=name,
            peers=None if self.peers else {"enabled": False},
            start=False,
        )
        text = node.config.read_text().replace(
            '[preemption]\nprovider = "none"\n',
            f'[preemption]\nprovider = "{provider}"\nendpoint = "{url}"\n'
            "poll_interval_seconds = 0.2\n",
        )
        node.config.write_text(text)
        slot.host, slot.root, slot.config = node.host, node.root, node.config
        slot.provider, slot.fake = provider, fake
        return slot

    def notice(self, rank: int, provider: str | None, window: float) -> None:
        slot = self.slots[rank]
        if slot.fake is not None:
            send_notice(slot.fake, provider or slot.provider, window)

    def gone(self, rank: int) -> None:
        """Slot ``rank``'s processes SIGKILLed, its host removed, its fake stopped."""
        slot = self.slots[rank]
        if slot.root is not None:
            kill_under(slot.root)
        if slot.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                slot.proc.wait(timeout=10)
        if slot.root is not None:
            keep = self.out / "hosts" / slot.root.name
            keep.mkdir(parents=True, exist_ok=True)
            for log in [*slot.root.glob("proc-*.log"), *slot.root.glob("*.log")]:
                shutil.copy2(log, keep / log.name)
        if slot.host is not None:
            self.prig.rig.remove_host(slot.host)
        if slot.fake is not None:
            slot.fake.stop_thread()
        slot.host = slot.root = slot.config = slot.fake = slot.proc = None  # type: ignore[assignment]

    def complete(self) -> bool:
        return all(slot.host is not None for slot in self.slots)

    # -- the job -------------------------------------------------------------------------

    def empty_disks(self) -> None:
        """Before a relaunch: each pod recreated, its checkpoint volume (an emptyDir)
        empty again (module doc); nothing with ``keep_disks``."""
        for slot in self.slots:
            if slot.starts and slot.root is not None and not self.keep_disks:
                shutil.rmtree(slot.node_dir, ignore_errors=True)
                slot.node_dir.mkdir(parents=True)

    def launch(self, resume: dict[int, Path] | None = None) -> None:
        """Every rank started (a new job: all slots must have a host); ``resume`` (plain
        mode) names each rank's checkpoint to resume from."""
        assert self.complete()
        self.generation += 1
        master = self.slots[0].host
        assert master is not None
        for slot in self.slots:
            assert slot.host is not None and slot.root is not None
            slot.starts += 1
            log = self.out / f"node{slot.rank}-a{slot.starts}.jsonl"
            trainer = [
                sys.executable, "-m", TRAINER, "--node-dir", str(slot.node_dir),
                "--log", str(log), "--node", str(slot.rank), "--attempt", str(slot.starts),
                *self.job.trainer_args(),
            ]  # fmt: skip
            env = {
                **os.environ,
                **S3_ENV,
                "PYTHONPATH": str(REPO),
                "PYTHONUNBUFFERED": "1",
                "RANK": str(slot.rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(self.job.nodes),
                "NODE_RANK": str(slot.rank),
                "MASTER_ADDR": master.address,
                "GLOO_SOCKET_IFNAME": slot.host.dev,  # not the hostname's 127.0.0.1
                "MASTER_PORT": str(29500 + self.generation % 400),
                "CKPTD_CLUSTER__JOB_ID": f"fleet-{self.generation}",
            }
            env.pop("CKPTD_RESUME_FROM", None)
            if self.mode == "exec":
                assert slot.config is not None
                argv = [
                    sys.executable, "-m", "ckptd", "exec", "--config", str(slot.config),
                    "--shutdown-timeout", "30", "--", *trainer,
                ]  # fmt: skip
            else:
                argv = trainer
                if resume and slot.rank in resume:
                    env["CKPTD_RESUME_FROM"] = str(resume[slot.rank])
            out = (slot.root / f"proc-{slot.starts}.log").open("ab")
            slot.proc = subprocess.Popen(
                slot.host.argv(argv),
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=REPO,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            out.close()

    def running(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.running()]

    def stop_job(self) -> None:
        """Every rank's processes SIGKILLed (hosts stay): the job torn down."""
        for slot in self.slots:
            if slot.root is not None:
                kill_under(slot.root)
            if slot.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    slot.proc.wait(timeout=10)

    def close(self) -> None:
        for slot in self.slots:
            if slot.host is not None:
                self.gone(slot.rank)

    def proc_logs(self, chars: int = 3000) -> str:
        parts = []
        for slot in self.slots:
            if slot.root is not None and slot.starts:
                path = slot.root / f"proc-{slot.starts}.log"
                if path.exists():
                    text = path.read_text(errors="replace")[-chars:]
                    parts.append(f"--- node {slot.rank} ({path}) ---\n{text}")
        return "\n".join(parts)


def kill_under(root: Path) -> list[int]:
    """SIGKILL every process whose command line names ``root`` (module doc); their PIDs."""
    mark = (str(root) + "/").encode()  # "n1h1/" is no prefix of "n1h10/"
    me = os.getpid()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if mark in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows
