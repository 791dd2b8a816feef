"""A real Slurm for one host, for the tests: munged, slurmctld and slurmd as this session's
children, every file under one temp dir (``../shared/facts/slurm-one-host.md`` measured
this configuration).

Two partitions on the one node: ``low`` (the default, ``PriorityTier=1``, ``GraceTime=30``,
preemptible: ``PreemptMode=REQUEUE``) and ``high`` (``PriorityTier=10``), preemption by
``preempt/partition_prio`` without a database. ``AuthInfo=cred_expire=10`` and
``sched_interval=5,bf_interval=5`` bring a requeued job back in ~14 s instead of ~150 s.
The node has one CPU in Slurm's eyes, so a job in ``high`` needs the node of a job in
``low``. The ports are free ones picked at start, not Slurm's defaults, and munged has its
own socket, so a system Slurm or munge on the host is never touched.

``stop()`` cancels what jobs remain, then ends exactly the three processes it started, by
PID. Only one such Slurm runs at a time (the tests' fixture is session-scoped).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.devtools.locals3 import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
GRACE_SECONDS = 30


class SlurmUnavailable(Exception):
    """Slurm or munge is not installed here (the tests skip with this line)."""


def find_binaries() -> dict[str, str]:
    """Paths of the daemons and client commands; SlurmUnavailable names what is missing."""
    found: dict[str, str] = {}
    missing = []
    for name in (*DAEMONS, "sbatch", "scontrol", "squeue", "scancel"):
        path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    if missing:
        raise SlurmUnavailable(
            f"Slurm is not installed ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm munge (.ci/run does)"
        )
    if os.geteuid() != 0:
        raise SlurmUnavailable("a one-host Slurm needs root (slurmd runs jobs as their user)")
    return found


def slurm_conf(root: Path, host: str, ctld_port: int, slurmd_port: int, munge_socket: Path) -> str:
    """The one-host configuration (module doc)."""
    return f"""\
ClusterName=ckptdtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SrunPortRange={slurmd_port + 1}-{slurmd_port + 200}
AuthType=auth/munge
AuthInfo=cred_expire=10,socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=sched_interval=5,bf_interval=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MinJobAge=600
NodeName={host} CPUs=1 State=UNKNOWN
PartitionName=low Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_SECONDS} PreemptMode=REQUEUE
PartitionName=high Nodes={host} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


@dataclass
class Slurm:
    """One running one-host Slurm (module doc); ``env`` is what its commands need."""

    root: Path
    bin: dict[str, str] = field(default_factory=find_binaries)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        # Not under root: pytest's temp dirs are 0700, and munged (user munge) checks
        # every directory on its socket's path.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="ckptd-munge-"))
        self.munge_socket = self.munge_dir / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        """The variables that point Slurm's commands (and jobs) at this Slurm."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60.0) -> Slurm:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge_dir = self.munge_dir
        shutil.chown(munge_dir, "munge", "munge")
        munge_dir.chmod(0o755)
        ctld_port, slurmd_port = free_port(), free_port()
        self.conf.write_text(
            slurm_conf(self.root, self.host, ctld_port, slurmd_port, self.munge_socket)
        )
        try:
            self._spawn(
                "munged",
                [
                    self.bin["munged"],
                    "--foreground",
                    f"--socket={self.munge_socket}",
                    f"--pid-file={munge_dir}/munged.pid",
                    f"--log-file={munge_dir}/munged.log",
                    f"--seed-file={munge_dir}/munged.seed",
                ],
                user="munge",
            )
            self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
            self._spawn("slurmctld", [self.bin["slurmctld"], "-D", "-f", str(self.conf)])
            self._spawn("slurmd", [self.bin["slurmd"], "-D", "-f", str(self.conf)])
            self._wait(self._node_idle, timeout, "the node to be idle in slurmctld")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str], user: str | None = None) -> None:
        log = (self.root / f"{name}.out").open("ab")
        with log:
            self.procs[name] = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                user=user,
                group=user,
                start_new_session=True,
            )

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        assert callable(ready)
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.1)

    def _node_idle(self) -> bool:
        done = self.command("sinfo", "-h", "-N", "-o", "%T", check=False)
        return done.returncode == 0 and "idle" in done.stdout

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", str(self.munge_dir / "munged.log")):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    # -- commands ------------------------------------------------------------------------

    def command(
        self,
        name: str,
        *args: str,
        check: bool = True,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """One Slurm client command against this Slurm, output captured; ``env`` (else
        this process's) plus ``SLURM_CONF``."""
        path = self.bin.get(name) or shutil.which(name) or name
        done = subprocess.run(
            [path, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**(os.environ if env is None else env), **self.env},
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{name} {' '.join(args)}: rc {done.returncode}: {done.stderr}")
        return done

    def submit(self, script: Path, *args: str, env: dict[str, str]) -> str:
        """``sbatch ARGS SCRIPT`` with ``env`` (a job gets its submitter's environment);
        the job id."""
        done = self.command("sbatch", "--parsable", *args, str(script), env=env)
        return done.stdout.strip().split(";")[0]

    def job_field(self, job_id: str, name: str) -> str:
        """One ``Key=Value`` field of ``scontrol show job`` ("" when absent)."""
        out = self.command("scontrol", "-o", "show", "job", job_id, check=False).stdout
        for token in out.split():
            key, _, value = token.partition("=")
            if key == name:
                return value
        return ""

    # -- stopping ------------------------------------------------------------------------

    def cancel_all(self, timeout: float = 90.0) -> None:
        """Cancel every job of this Slurm and wait until none runs."""
        if "slurmctld" not in self.procs or self.procs["slurmctld"].poll() is not None:
            return
        self.command("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.command("squeue", "-h", "-o", "%i", check=False).stdout
            if not out.strip():
                return
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel the jobs, then end the three daemons this started, by PID."""
        try:
            self.cancel_all()
        finally:
            for name in reversed(DAEMONS):
                proc = self.procs.pop(name, None)
                if proc is None or proc.poll() is not None:
                    continue
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            shutil.rmtree(self.munge_dir, ignore_errors=True)
