"""How fast ckptd turns a cloud's preemption notice into a signal, and into a commit.

    .venv/bin/python bench/bench_preemption.py [--trials 30] [--commit-trials 3]
        [--emergency-mib 1024] [--poll-interval S] [--settle-seconds S]
        [--providers aws,gcp,azure,gcp-maintenance] [--phases latency,commit]
        [--quick] [--json FILE] [--seed N] [--workdir DIR] [--keep] [--trace-stalls]
        [--modes late,early,reported] [--dest s3,file]

Two measurements, each driving ``python -m ckptd run`` as a real process against the
loopback fakes of the metadata services (``tests/support/fakes``, served from a thread of this
process):

1. **notice -> signal**, per provider. The "trainer" is ``_signal_receiver.py``, which
   writes ``CLOCK_MONOTONIC`` at each SIGUSR1's arrival; this process reads the same
   clock (one per boot on Linux, shared by every process) just before it publishes the
   notice in the fake. Before each trigger it waits a random fraction of the poll
   interval, so the trigger falls at a uniformly random point of the daemon's poll cycle
   (otherwise every trial would start at the same phase). The responder acts once per
   notice id, so each trial publishes a new id in the same daemon:
   - aws: a new spot ``instance-action`` ``time`` (the id is ``spot:<action>:<time>``);
   - azure: a new ``Preempt`` event (new ``EventId``); the previous one is removed;
   - gcp: ``instance/preempted`` has one id for a VM's life (``"preempted"``: the source
     re-arms on ``FALSE`` but the responder remembers the id), so the daemon is restarted
     (SIGKILL, so no SIGTERM notice reaches the receiver) before each trial, and the
     trigger waits until its hanging GET is in place;
   - gcp-maintenance: ``instance/maintenance-event`` ``TERMINATE_ON_HOST_MAINTENANCE``,
     back to ``NONE`` between trials (ids carry the time), in one daemon: the steady-state
     hanging GET.
   Each latency is split into: waiting for the next poll (the fake's request log: same
   process, same clock), poll -> ``notice_received`` (the daemon's log), -> the notice
   file renamed into place (its ctime, read by the receiver at the signal), ->
   ``trainer_signalled`` (logged after ``os.kill``), -> the receiver's handler ran. Beside
   them, the time the daemon's threads and the receiver were runnable without a CPU
   (``/proc/<pid>/task/*/schedstat``) and the machine's CPU pressure (PSI), which tell a
   slow daemon from a busy machine; ``--trace-stalls`` also samples the daemon's threads'
   kernel stacks (root) and prints what they waited on in a slow trial.
2. **notice -> committed**, on AWS's fake (a two-minute notice), against loopback
   SeaweedFS (``ckptd.devtools.locals3``) and/or a ``file://`` destination on the same disk
   (``--dest s3,file``: where the store keeps up with the save). The trainer, ``_emergency_trainer.py``, has its random
   bytes generated before the notice; when signalled it writes an HF-shaped checkpoint of
   ``--emergency-mib`` (fsynced, ``trainer_state.json`` last) and exits. The daemon's
   ``emergency_checkpoint_committed`` event gives noticed -> signalled -> complete ->
   committed; this process times trigger -> the manifest object being readable (boto3
   ``head_object``, or the manifest file's existence, every 20 ms). A fresh daemon, trainer, fake and prefix per trial.

The daemon runs with its defaults (``poll_interval_seconds``, ``settle_seconds``) unless
overridden, and the tables say which values were used. ``--modes`` runs each commit
trial once per mode, interleaved trial by trial, one table each plus the daemon's
whole-process CPU per GiB (``/proc/<pid>/stat`` at the end of the trial):

- ``late``: ``[[watch]] ship_early = false`` and the trainer reports nothing: the upload
  starts once the completion rule holds, after its quiet window (ckptd before #18);
- ``early``: ``ship_early = true``: closed, quiet files go while the trainer still saves;
- ``reported``: ``ship_early = true`` and the trainer calls ``ckptd.trainer.report_save``
  after its save, as the HF callback does: no quiet window after the commit record.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import functools
import itertools
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # run as a script: find the tests' fakes and daemon driver
sys.path.insert(0, str(BENCH_DIR))  # and common

import botocore.exceptions  # noqa: E402
from common import BUCKET, MIB, delete_prefix  # noqa: E402

import ckptd  # noqa: E402
from ckptd.config import PreemptionConfig, WatchConfig  # noqa: E402
from ckptd.devtools.locals3 import (  # noqa: E402
    ACCESS_KEY,
    SECRET_KEY,
    LocalS3,
    free_port,
    s3_client,
)
from tests.support.daemon import Daemon, wait_until  # noqa: E402
from tests.support.fakes import FakeServer, RecordedRequest  # noqa: E402
from tests.support.fakes.aws_imds import FakeAwsImds, rfc3339  # noqa: E402
from tests.support.fakes.azure_metadata import FakeAzureMetadata  # noqa: E402
from tests.support.fakes.gcp_metadata import FakeGcpMetadata  # noqa: E402

RECEIVER = BENCH_DIR / "_signal_receiver.py"
TRAINER = BENCH_DIR / "_emergency_trainer.py"
ALL_PROVIDERS = ("aws", "gcp", "azure", "gcp-maintenance")
DEFAULT_PROVIDERS = ALL_PROVIDERS
AWS_SPOT = "/latest/meta-data/spot/instance-action"
AZURE_EVENTS = "/metadata/scheduledevents"
GCP_PREEMPTED = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE = "/computeMetadata/v1/instance/maintenance-event"
DEFAULT_POLL = float(PreemptionConfig.model_fields["poll_interval_seconds"].default)
DEFAULT_SETTLE = float(WatchConfig.model_fields["settle_seconds"].default)


# --- small helpers ------------------------------------------------------------------------


def now_ns() -> int:
    return time.monotonic_ns()


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); q in [0, 1]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None


def ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{round(value * 1000)} ms"


def pair(mid: float | None, top: float | None) -> str:
    """ "median / max" in ms, or "-" when there is nothing to show."""
    return "-" if mid is None else f"{ms(mid)} / {ms(top)}"


def sec(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f} s"


def event_wall(doc: dict[str, Any]) -> float:
    """A structlog ISO timestamp (``...Z``) as Unix seconds."""
    return dt.datetime.fromisoformat(str(doc["timestamp"])).timestamp()


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mem_total_gib() -> float:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1024 * 1024)
    return 0.0


def machine() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "mem_gib": round(mem_total_gib(), 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "ckptd": getattr(ckptd, "__version__", "unknown"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def runqueue_wait_ns(pid: int) -> dict[int, int]:
    """Per thread of ``pid``: nanoseconds spent runnable but waiting for a CPU
    (``/proc/<pid>/task/<tid>/schedstat``, second field)."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[int(task.name)] = int((task / "schedstat").read_text().split()[1])
    return out


def cpu_pressure_us() -> int | None:
    """Machine-wide PSI: microseconds during which some runnable task waited for a CPU."""
    try:
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some "):
                return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class CpuWait:
    """Run-queue waits over one trial: is a slow trial the daemon, or the machine?"""

    pid: int
    threads_before: dict[int, int]
    pressure_before: int | None

    @classmethod
    def start(cls, pid: int) -> CpuWait:
        return cls(pid, runqueue_wait_ns(pid), cpu_pressure_us())

    def stop(self) -> tuple[float, float, float | None]:
        """(daemon main thread, all daemon threads, machine "some" pressure), seconds."""
        after, pressure = runqueue_wait_ns(self.pid), cpu_pressure_us()
        deltas = {tid: ns - self.threads_before.get(tid, 0) for tid, ns in after.items()}
        machine = (
            None
            if pressure is None or self.pressure_before is None
            else (pressure - self.pressure_before) / 1e6
        )
        return deltas.get(self.pid, 0) / 1e9, sum(deltas.values()) / 1e9, machine


@dataclass(frozen=True)
class ThreadSample:
    mono_ns: int
    tid: int
    state: str  # R running/runnable, S sleeping, D uninterruptible (I/O)...
    kernel: str  # the top kernel frames of a thread that is not running


def read_thread(pid: int, tid: int) -> tuple[str, str] | None:
    base = Path(f"/proc/{pid}/task/{tid}")
    try:
        stat = (base / "stat").read_text()
        state = stat[stat.rindex(")") + 2]
        frames = []
        if state != "R":
            # Deep enough to reach the system call of a thread blocked in the kernel.
            depth = 14 if state == "D" else 4
            for line in (base / "stack").read_text().splitlines()[:depth]:
                name = line.split("] ", 1)[-1].split("+", 1)[0]
                frames.append(name)
        return state, "<".join(frames)
    except (OSError, ValueError, IndexError):
        return None


class StallSampler:
    """``--trace-stalls``: every 5 ms during a trial, each daemon thread's state and kernel
    stack (``/proc/<pid>/task/<tid>/{stat,stack}``; the stack needs root), to show what a
    slow notice -> signal was waiting on."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.samples: list[ThreadSample] = []
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-sampler", daemon=True)
        self._thread.start()

    def begin(self, pid: int) -> None:
        with self._lock:
            self._pid = pid

    def end(self) -> None:
        with self._lock:
            self._pid = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                pid = self._pid
            if pid is None:
                continue
            now = now_ns()
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    got = read_thread(pid, int(task.name))
                    if got is not None:
                        with self._lock:
                            self.samples.append(ThreadSample(now, int(task.name), *got))

    def summary(self, pid: int, start_ns: int, end_ns: int) -> list[str]:
        """Per thread, what it was doing between two monotonic times (most samples first)."""
        with self._lock:
            window = [x for x in self.samples if start_ns <= x.mono_ns <= end_ns]
        by_thread: dict[int, collections.Counter[str]] = {}
        for x in window:
            key = x.state if not x.kernel else f"{x.state} {x.kernel}"
            by_thread.setdefault(x.tid, collections.Counter())[key] += 1
        lines = []
        for tid, counts in sorted(by_thread.items()):
            label = "main (event loop)" if tid == pid else f"thread {tid}"
            top = ", ".join(f"{n} x {k}" for k, n in counts.most_common(4))
            lines.append(f"{label}: {top}")
        return lines


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    """End one process this benchmark started, by its PID."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def kill_daemon(daemon: Daemon) -> None:
    """SIGKILL, not SIGTERM: the daemon takes its own SIGTERM as a notice and would
    signal the receiver once more."""
    if daemon.proc is not None:
        stop_process(daemon.proc, signal.SIGKILL)
        daemon.proc = None


def write_daemon_config(
    path: Path,
    *,
    watch_dir: Path,
    dest: str,
    endpoint_url: str,
    provider: str,
    metadata_url: str,
    pidfile: Path,
    state_dir: Path,
    port: int,
    poll_interval: float | None,
    settle_seconds: float | None,
    ship_early: bool | None = None,
) -> None:
    """A ckptd config that leaves every tuning knob at its default unless overridden."""
    lines = ["[[watch]]", f"dir = {json.dumps(str(watch_dir))}", 'run_id = "run"']
    if ship_early is not None:
        lines.append(f"ship_early = {'true' if ship_early else 'false'}")
    if settle_seconds is not None:
        lines.append(f"settle_seconds = {settle_seconds!r}")
    lines += ["[destination]", f"url = {json.dumps(dest)}"]
    if endpoint_url:
        lines.append(f"endpoint_url = {json.dumps(endpoint_url)}")
    lines += [
        "[preemption]",
        f"provider = {json.dumps(provider)}",
        f"endpoint = {json.dumps(metadata_url)}",
    ]
    if poll_interval is not None:
        lines.append(f"poll_interval_seconds = {poll_interval!r}")
    lines += ["[trainer]", f"pidfile = {json.dumps(str(pidfile))}"]
    lines += ["[metrics]", f'listen = "127.0.0.1:{port}"']
    lines += ["[state]", f"dir = {json.dumps(str(state_dir))}"]
    path.write_text("\n".join(lines) + "\n")


def make_daemon(
    workdir: Path,
    name: str,
    *,
    watch_dir: Path,
    dest: str,
    endpoint_url: str,
    provider: str,
    metadata_url: str,
    pidfile: Path,
    options: Options,
    ship_early: bool | None = None,
) -> Daemon:
    port = free_port()
    config = workdir / f"{name}.toml"
    write_daemon_config(
        config,
        watch_dir=watch_dir,
        dest=dest,
        endpoint_url=endpoint_url,
        provider=provider,
        metadata_url=metadata_url,
        pidfile=pidfile,
        state_dir=workdir / f"{name}-state",
        port=port,
        poll_interval=options.poll_interval,
        settle_seconds=options.settle_seconds,
        ship_early=ship_early,
    )
    return Daemon(config, workdir / f"{name}.log", port)


def requests_to(
    fake: FakeServer, path: str, *, since: float, hanging: bool | None = None
) -> list[RecordedRequest]:
    """GETs of ``path`` that reached the fake at or after monotonic ``since``."""
    out = []
    for r in fake.requests:
        if r.method != "GET" or r.path != path or r.at < since:
            continue
        if hanging is not None and (r.query.get("wait_for_change") == "true") != hanging:
            continue
        out.append(r)
    return out


# --- options ------------------------------------------------------------------------------


#: Commit-trial modes (module doc): mode -> (ship_early, the trainer reports its save).
MODE_SETTINGS: dict[str, tuple[bool, bool]] = {
    "late": (False, False),
    "early": (True, False),
    "reported": (True, True),
}
MODES = tuple(MODE_SETTINGS)


@dataclass(frozen=True)
class Options:
    trials: int
    commit_trials: int
    emergency_mib: float
    poll_interval: float | None  # None: the daemon's default
    settle_seconds: float | None  # None: the daemon's default
    providers: tuple[str, ...]
    phases: tuple[str, ...]
    seed: int
    quick: bool
    trace_stalls: bool = False
    modes: tuple[str, ...] = MODES
    dests: tuple[str, ...] = ("s3",)

    @property
    def effective_poll(self) -> float:
        return self.poll_interval if self.poll_interval is not None else DEFAULT_POLL

    @property
    def effective_settle(self) -> float:
        return self.settle_seconds if self.settle_seconds is not None else DEFAULT_SETTLE


# --- phase 1: notice -> signal ------------------------------------------------------------

#: A hanging GET should answer within this; above it a trial is listed as an anomaly.
HANGING_GET_BOUND_S = 0.1
#: With --trace-stalls, what the daemon's threads did is shown for trials over the bound,
#: and those whose notice_received -> signal took longer than this.
STALL_TRACE_FROM_S = 0.05


def bound(provider: str, poll: float) -> float:
    """The contract: signalled within one poll interval (near at once for a hanging GET)."""
    return poll if provider in ("aws", "azure") else HANGING_GET_BOUND_S


@dataclass(frozen=True)
class Arrival:
    """One signal as the receiver saw it (ns; the notice file's times 0 when absent)."""

    mono_ns: int  # CLOCK_MONOTONIC at arrival
    wall_ns: int  # CLOCK_REALTIME just after
    notice_mtime_ns: int  # the daemon wrote the notice file (to its temporary name)
    notice_ctime_ns: int  # the daemon renamed it into place


class Receiver:
    """``_signal_receiver.py`` as a subprocess, and the signals it recorded."""

    def __init__(self, workdir: Path, notice_file: Path) -> None:
        self.pidfile = workdir / "receiver.pid"
        self.record = workdir / "receiver.arrivals"
        self.record.write_text("")
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [
                sys.executable,
                str(RECEIVER),
                "--pidfile",
                str(self.pidfile),
                "--record",
                str(self.record),
                "--notice-file",
                str(notice_file),
            ],
            stdin=subprocess.DEVNULL,
        )
        wait_until(self.pidfile.exists, 30, "the signal receiver's pidfile")

    def arrivals(self) -> list[Arrival]:
        out = []
        for line in self.record.read_text().splitlines():
            fields = line.split()
            if len(fields) == 4:  # a line being written is skipped until complete
                out.append(Arrival(*(int(x) for x in fields)))
        return out

    def wait_for(self, count: int, timeout: float) -> Arrival | None:
        """The ``count``-th arrival (1-based), or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.arrivals()
            if len(got) >= count:
                return got[count - 1]
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"signal receiver exited {self.proc.returncode}")
            time.sleep(0.002)
        return None

    def close(self) -> None:
        stop_process(self.proc)
        self.proc = None


@dataclass
class LatencyTrial:
    """One notice -> signal trial; every ``*_s`` is seconds, None when not measurable."""

    provider: str
    trial: int
    latency_s: float | None  # trigger -> the receiver's SIGUSR1 handler ran
    # Where it went, in order (clocks: this process's and the fake's CLOCK_MONOTONIC, the
    # daemon's log timestamps and the notice file's times on CLOCK_REALTIME):
    poll_wait_s: float | None = None  # trigger -> the next poll reached the fake (polling)
    poll_to_notice_s: float | None = None  # that poll -> daemon's notice_received
    noticed_s: float | None = None  # trigger -> notice_received
    notice_file_s: float | None = None  # notice_received -> notice file renamed into place
    file_to_kill_s: float | None = None  # renamed -> trainer_signalled (after os.kill)
    kill_to_handler_s: float | None = None  # trainer_signalled -> the receiver's handler
    notice_to_signal_s: float | None = None  # notice_received -> the receiver's handler
    # Trigger -> handler: time the daemon's event-loop thread (and all its threads), and the
    # receiver, were runnable but had no CPU; and the machine's PSI "some" CPU stall time.
    daemon_loop_cpu_wait_s: float | None = None
    daemon_threads_cpu_wait_s: float | None = None
    receiver_cpu_wait_s: float | None = None
    machine_cpu_pressure_s: float | None = None
    extra_signals: int = 0  # arrivals beyond one per trial (must stay 0)
    error: str | None = None
    log_excerpt: list[str] = field(default_factory=list)
    stall_trace: list[str] = field(default_factory=list)  # --trace-stalls


@dataclass
class PollStats:
    provider: str
    path: str
    gaps_s: list[float]


class Harness:
    """One provider's fake, how to publish a new notice, and how to re-arm."""

    name = ""
    daemon_provider = ""
    poll_path: str | None = None  # the polled path (None: hanging GET, no poll to wait for)
    restart_per_trial = False

    def __init__(self, fake: FakeServer) -> None:
        self.fake = fake
        self.url = fake.start_in_thread()

    def ready(self, since: float) -> bool:
        """The daemon is watching in steady state (requests seen since ``since``)."""
        assert self.poll_path is not None
        return len(requests_to(self.fake, self.poll_path, since=since)) >= 2

    def trigger(self, trial: int) -> None:
        raise NotImplementedError

    def rearm(self) -> float:
        """Undo the last trigger where needed; returns a monotonic time to be ready after."""
        return time.monotonic()

    def close(self) -> None:
        self.fake.stop_thread()


class AwsHarness(Harness):
    name = daemon_provider = "aws"
    poll_path = AWS_SPOT

    def __init__(self) -> None:
        self.imds = FakeAwsImds()
        super().__init__(self.imds)
        self._last: dt.datetime | None = None

    def trigger(self, trial: int) -> None:
        # A new ``time`` is a new notice id; the time has whole seconds, so keep them apart.
        at = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=2)
        if self._last is not None and rfc3339(at) <= rfc3339(self._last):
            at = self._last + dt.timedelta(seconds=1)
        self._last = at
        self.imds.trigger_spot("terminate", at=at)


class AzureHarness(Harness):
    name = daemon_provider = "azure"
    poll_path = AZURE_EVENTS

    def __init__(self) -> None:
        self.azure = FakeAzureMetadata()
        super().__init__(self.azure)
        self._event: str | None = None

    def trigger(self, trial: int) -> None:
        self._event = self.azure.add_event("Preempt")

    def rearm(self) -> float:
        # Gone from the document = cancelled; the daemon clears the notice on its next poll.
        if self._event is not None:
            self.azure.remove_event(self._event)
            self._event = None
        return time.monotonic()


class GcpPreemptedHarness(Harness):
    name = "gcp"
    daemon_provider = "gcp"
    restart_per_trial = True

    def __init__(self) -> None:
        self.gcp = FakeGcpMetadata()
        super().__init__(self.gcp)

    def ready(self, since: float) -> bool:
        return bool(requests_to(self.gcp, GCP_PREEMPTED, since=since, hanging=True))

    def trigger(self, trial: int) -> None:
        self.gcp.preempt()

    def rearm(self) -> float:
        self.gcp.set_value("preempted", "FALSE")  # before the daemon restarts
        return time.monotonic()


class GcpMaintenanceHarness(Harness):
    name = "gcp-maintenance"
    daemon_provider = "gcp"

    def __init__(self) -> None:
        self.gcp = FakeGcpMetadata()
        super().__init__(self.gcp)

    def ready(self, since: float) -> bool:
        return bool(requests_to(self.gcp, GCP_MAINTENANCE, since=since, hanging=True))

    def trigger(self, trial: int) -> None:
        self.gcp.set_maintenance("TERMINATE_ON_HOST_MAINTENANCE")

    def rearm(self) -> float:
        # The hanging GET returns NONE; wait for the next one before triggering again.
        since = time.monotonic()
        self.gcp.set_maintenance("NONE")
        return since


HARNESSES: dict[str, Callable[[], Harness]] = {
    "aws": AwsHarness,
    "azure": AzureHarness,
    "gcp": GcpPreemptedHarness,
    "gcp-maintenance": GcpMaintenanceHarness,
}


def start_and_wait_ready(daemon: Daemon, harness: Harness) -> None:
    since = time.monotonic()
    daemon.start()
    wait_until(lambda: harness.ready(since), 30, f"{harness.name}: the daemon watching the fake")


def run_latency(
    provider: str, options: Options, workdir: Path, rng: random.Random
) -> tuple[list[LatencyTrial], PollStats | None]:
    work = workdir / f"latency-{provider}"
    watch = work / "run"
    watch.mkdir(parents=True)
    dest = work / "dest"
    dest.mkdir()
    poll = options.effective_poll
    trials: list[LatencyTrial] = []
    triggers: list[tuple[int, float, Arrival | None]] = []  # (t0 ns, wall - mono, arrival)
    pids: list[int] = []  # the daemon's, per trial
    with contextlib.ExitStack() as stack:
        sampler = StallSampler() if options.trace_stalls else None
        if sampler is not None:
            stack.callback(sampler.close)
        harness = HARNESSES[provider]()
        stack.callback(harness.close)
        receiver = Receiver(work, watch / ".ckptd" / "preemption.json")
        stack.callback(receiver.close)
        daemon = make_daemon(
            work,
            "daemon",
            watch_dir=watch,
            dest=dest.as_uri(),
            endpoint_url="",
            provider=harness.daemon_provider,
            metadata_url=harness.url,
            pidfile=receiver.pidfile,
            options=options,
        )
        stack.callback(kill_daemon, daemon)
        ready_after = time.monotonic()  # ready: requests seen since then
        if not harness.restart_per_trial:
            start_and_wait_ready(daemon, harness)
        for i in range(options.trials):
            if harness.restart_per_trial:
                kill_daemon(daemon)
                harness.rearm()
                start_and_wait_ready(daemon, harness)
            else:
                wait_until(
                    functools.partial(harness.ready, ready_after),
                    30,
                    f"{provider}: the daemon watching again before trial {i + 1}",
                )
            assert daemon.proc is not None
            if sampler is not None:  # from before the pause: the poll before the trigger too
                sampler.begin(daemon.proc.pid)
            # A random phase of the poll cycle (the cycle is the interval plus the poll).
            time.sleep(rng.uniform(0.05, 0.05 + poll))
            before = len(receiver.arrivals())
            waits = CpuWait.start(daemon.proc.pid)
            assert receiver.proc is not None
            receiver_waits = CpuWait.start(receiver.proc.pid)
            pids.append(daemon.proc.pid)
            wall0, t0 = time.time(), now_ns()
            harness.trigger(i)
            arrived = receiver.wait_for(before + 1, timeout=10 + 3 * poll)
            if sampler is not None:
                sampler.end()
            loop_wait, threads_wait, pressure = waits.stop()
            receiver_wait = receiver_waits.stop()[0]
            offset = wall0 - t0 / 1e9
            triggers.append((t0, offset, arrived))
            trial = LatencyTrial(
                provider, i, None if arrived is None else (arrived.mono_ns - t0) / 1e9
            )
            trial.daemon_loop_cpu_wait_s = loop_wait
            trial.daemon_threads_cpu_wait_s = threads_wait
            trial.machine_cpu_pressure_s = pressure
            trial.receiver_cpu_wait_s = receiver_wait
            if arrived is None:
                trial.error = "no signal within the timeout"
            trials.append(trial)
            if not harness.restart_per_trial:
                ready_after = harness.rearm()
                if harness.poll_path is not None:
                    ready_after = time.monotonic() - 10  # polling: ready already
        time.sleep(0.2)  # any late, extra signal would show up now
        total_arrivals = len(receiver.arrivals())
        kill_daemon(daemon)
        events = daemon.events()
        requests = harness.fake.requests
    signalled = sum(1 for t in trials if t.latency_s is not None)
    if total_arrivals > signalled and trials:
        trials[-1].extra_signals = total_arrivals - signalled
    notices = sorted(event_wall(e) for e in events if e.get("event") == "notice_received")
    kills = sorted(event_wall(e) for e in events if e.get("event") == "trainer_signalled")
    for trial, (t0, offset, arrived), pid in zip(trials, triggers, pids, strict=True):
        t0_s = t0 / 1e9
        handler_wall = None if arrived is None else arrived.wall_ns / 1e9
        if harness.poll_path is not None:
            polls = [r.at for r in requests if r.path == harness.poll_path and r.method == "GET"]
            after = [a for a in polls if a >= t0_s]
            if after:
                trial.poll_wait_s = after[0] - t0_s
        noticed = next((w for w in notices if w - offset >= t0_s - 0.002), None)
        if noticed is not None:
            trial.noticed_s = noticed - offset - t0_s
            if trial.poll_wait_s is not None:
                trial.poll_to_notice_s = trial.noticed_s - trial.poll_wait_s
            if arrived is not None and handler_wall is not None:
                trial.notice_to_signal_s = arrived.mono_ns / 1e9 - (noticed - offset)
                renamed = arrived.notice_ctime_ns / 1e9
                # The file is rewritten per notice; an earlier notice's does not count (the
                # kernel's coarse file clock may put a fresh one a tick before the log line).
                fresh = renamed >= noticed - 0.01 and arrived.notice_mtime_ns > 0
                if fresh:
                    trial.notice_file_s = renamed - noticed
                kill = next((w for w in kills if w >= noticed), None)
                if kill is not None and kill <= handler_wall + 0.01:
                    trial.kill_to_handler_s = handler_wall - kill
                    if fresh:
                        trial.file_to_kill_s = kill - renamed
        over = trial.latency_s is None or trial.latency_s > bound(provider, poll)
        slow_daemon = (trial.notice_to_signal_s or 0.0) > STALL_TRACE_FROM_S
        if sampler is not None and arrived is not None and (over or slow_daemon):
            # From the last poll before the trigger when the trial was slow as a whole,
            # else from notice_received: what the daemon's threads were doing meanwhile.
            start = (
                t0 - int(1.2 * poll * 1e9)
                if over or noticed is None
                else int((noticed - offset) * 1e9)
            )
            trial.stall_trace = sampler.summary(pid, start, arrived.mono_ns)
        if over or trial.stall_trace:
            until = (arrived.mono_ns if arrived is not None else t0) / 1e9 + 1.0
            trial.log_excerpt = log_excerpt(events, t0_s, offset, until)
    stats = None
    if harness.poll_path is not None:
        polls = sorted(r.at for r in requests if r.path == harness.poll_path and r.method == "GET")
        stats = PollStats(
            provider, harness.poll_path, [b - a for a, b in itertools.pairwise(polls)]
        )
    return trials, stats


def log_excerpt(
    events: list[dict[str, Any]], t0_s: float, offset: float, until_s: float
) -> list[str]:
    """Daemon log events from 1.5 s before a trigger to ``until_s``, times relative to it."""
    out = []
    for e in events:
        with contextlib.suppress(KeyError, ValueError):
            at = event_wall(e) - offset
            if t0_s - 1.5 <= at <= until_s:
                rest = {k: v for k, v in e.items() if k not in ("event", "timestamp", "level")}
                out.append(f"{(at - t0_s) * 1000:+8.1f} ms {e['event']} {json.dumps(rest)[:160]}")
    return out


# --- phase 2: notice -> committed ---------------------------------------------------------


@dataclass
class CommitTrial:
    trial: int
    mode: str = "reported"
    dest: str = "s3"
    daemon_cpu_s: float | None = None  # the daemon process's user+system CPU, start to commit
    checkpoint: str | None = None
    bytes: int = 0
    noticed_s: float | None = None  # trigger -> daemon's notice_received
    signalled_after_s: float | None = None  # daemon: noticed -> signal sent
    trainer_saw_s: float | None = None  # trigger -> trainer's preempted() was True
    save_s: float | None = None  # trainer: write + fsync of the checkpoint
    saved_to_complete_s: float | None = None  # trainer done -> daemon found it complete
    complete_to_committed_s: float | None = None  # daemon: upload, verify, manifest
    daemon_committed_s: float | None = None  # trigger -> committed (daemon's clock)
    notice_to_committed_s: float | None = None  # daemon: notice_received -> committed
    manifest_visible_s: float | None = None  # trigger -> manifest readable (boto3, here)
    seconds_left_at_commit: float | None = None
    committed_before_deadline: bool | None = None
    daemon_event: dict[str, Any] = field(default_factory=dict)  # emergency_checkpoint_committed
    error: str | None = None


def object_exists(s3: Any, key: str) -> bool:
    try:
        s3.head_object(Bucket=BUCKET, Key=key)
    except botocore.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, from ``/proc/<pid>/stat``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_commit_trial(
    i: int,
    options: Options,
    workdir: Path,
    local_s3: LocalS3,
    s3: Any,
    rng: random.Random,
    mode: str = "reported",
    dest: str = "s3",
) -> CommitTrial:
    ship_early, report = MODE_SETTINGS[mode]
    work = workdir / f"commit-{i}-{mode}-{dest}"
    watch = work / "run"
    watch.mkdir(parents=True)
    pidfile = work / "trainer.pid"
    result_path = work / "trainer.json"
    prefix = f"bench-preemption-{uuid.uuid4().hex[:8]}-{i}"
    out = CommitTrial(i, mode=mode, dest=dest)
    store = work / "store"
    poll = options.effective_poll
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, watch, True)  # the data; the logs stay with --keep
        stack.callback(delete_prefix, s3, prefix + "/")
        stack.callback(shutil.rmtree, store, True)
        trainer = subprocess.Popen(
            [
                sys.executable,
                str(TRAINER),
                "--dir",
                str(watch),
                "--pidfile",
                str(pidfile),
                "--mib",
                str(options.emergency_mib),
                "--result",
                str(result_path),
                *(["--report"] if report else []),
            ],
            stdin=subprocess.DEVNULL,
        )
        stack.callback(stop_process, trainer, signal.SIGKILL)
        wait_until(
            lambda: (watch / ".ready").exists() or trainer.poll() is not None,
            300,
            "the trainer generating its data",
        )
        if trainer.poll() is not None:
            out.error = f"trainer exited {trainer.returncode} before the notice"
            return out
        harness = AwsHarness()
        stack.callback(harness.close)
        daemon = make_daemon(
            work,
            "daemon",
            watch_dir=watch,
            dest=f"s3://{BUCKET}/{prefix}" if dest == "s3" else f"file://{store}",
            endpoint_url=local_s3.endpoint_url if dest == "s3" else "",
            provider="aws",
            metadata_url=harness.url,
            pidfile=pidfile,
            options=options,
            ship_early=ship_early,
        )
        stack.callback(kill_daemon, daemon)
        start_and_wait_ready(daemon, harness)
        time.sleep(rng.uniform(0.05, 0.05 + poll))
        wall0, t0 = time.time(), now_ns()
        harness.trigger(0)
        offset = wall0 - t0 / 1e9
        deadline = time.monotonic() + 300
        try:
            wait_until(
                lambda: result_path.exists() or trainer.poll() is not None,
                300,
                "the trainer's emergency save",
                interval=0.005,
            )
            if not result_path.exists():
                out.error = f"trainer exited {trainer.returncode} without saving"
                return out
            saved = json.loads(result_path.read_text())
            out.checkpoint, out.bytes = str(saved["checkpoint"]), int(saved["bytes"])
            key = f"{prefix}/run/{out.checkpoint}/ckptd.manifest.json"
            manifest = store / "run" / out.checkpoint / "ckptd.manifest.json"
            while not (manifest.exists() if dest == "file" else object_exists(s3, key)):
                if time.monotonic() > deadline:
                    raise AssertionError("timed out waiting for the manifest")
                if not daemon.alive():
                    raise AssertionError(f"daemon exited:\n{daemon.log_text()[-3000:]}")
                time.sleep(0.02)
            out.manifest_visible_s = (now_ns() - t0) / 1e9
            if daemon.proc is not None:
                out.daemon_cpu_s = process_cpu_s(daemon.proc.pid)
            done = wait_until(
                lambda: daemon.events_named("emergency_checkpoint_committed"),
                30,
                "the emergency_checkpoint_committed event",
            )
        except AssertionError as exc:
            tail = [
                f"{e.get('timestamp', '')[11:23]} {e.get('event')} "
                + json.dumps({k: v for k, v in e.items() if k not in ("event", "timestamp")})[:200]
                for e in daemon.events()[-25:]
            ]
            out.error = str(exc) + "; the daemon's last log events:\n" + "\n".join(tail)
            return out
        with contextlib.suppress(subprocess.TimeoutExpired):
            trainer.wait(timeout=30)
        timings = done[0]
        out.daemon_event = dict(timings)
        t0_s = t0 / 1e9
        out.trainer_saw_s = saved["seen_ns"] / 1e9 - t0_s
        out.save_s = (saved["save_end_ns"] - saved["seen_ns"]) / 1e9
        noticed = [
            event_wall(e) - offset for e in daemon.events() if e.get("event") == "notice_received"
        ]
        out.signalled_after_s = timings.get("signalled_after_s")
        out.seconds_left_at_commit = timings.get("seconds_left_at_commit")
        out.committed_before_deadline = timings.get("committed_before_deadline")
        complete, committed = timings.get("complete_after_s"), timings.get("committed_after_s")
        out.notice_to_committed_s = committed
        if complete is not None and committed is not None:
            out.complete_to_committed_s = committed - complete
        if noticed:
            out.noticed_s = noticed[0] - t0_s
            if committed is not None:
                out.daemon_committed_s = out.noticed_s + committed
            if complete is not None:
                out.saved_to_complete_s = noticed[0] + complete - saved["save_end_ns"] / 1e9
    return out


# --- reporting ----------------------------------------------------------------------------


#: (attribute, label) of the columns of the "where the time went" table.
BREAKDOWN: tuple[tuple[str, str], ...] = (
    ("poll_wait_s", "trigger → next poll at the fake"),
    ("poll_to_notice_s", "poll → `notice_received`"),
    ("noticed_s", "trigger → `notice_received`"),
    ("notice_file_s", "→ notice file renamed"),
    ("file_to_kill_s", "→ `trainer_signalled`"),
    ("kill_to_handler_s", "→ receiver's handler ran"),
    ("daemon_loop_cpu_wait_s", "daemon loop's CPU wait"),
    ("receiver_cpu_wait_s", "receiver's CPU wait"),
    ("machine_cpu_pressure_s", "machine CPU pressure"),
)


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    present = [v for v in values if v is not None]
    return {"median": median(present), "max": max(present) if present else None}


def latency_summary(trials: list[LatencyTrial], stats: PollStats | None) -> dict[str, Any]:
    got = [t.latency_s for t in trials if t.latency_s is not None]
    gaps = stats.gaps_s if stats is not None else []
    return {
        "trials": len(trials),
        "signalled": len(got),
        "median_s": percentile(got, 0.5),
        "p90_s": percentile(got, 0.9),
        "p99_s": percentile(got, 0.99),
        "max_s": max(got) if got else math.nan,
        "min_s": min(got) if got else math.nan,
        "mean_s": statistics.fmean(got) if got else math.nan,
        "breakdown": {
            attr: spread([getattr(t, attr) for t in trials])
            for attr in (
                *(a for a, _ in BREAKDOWN),
                "notice_to_signal_s",
                "daemon_threads_cpu_wait_s",
            )
        },
        "poll_period_s": spread(list(gaps)),
        "extra_signals": sum(t.extra_signals for t in trials),
    }


def header(info: dict[str, Any], options: Options) -> list[str]:
    return [
        "# ckptd preemption benchmark",
        "",
        f"Machine: nproc {info['nproc']}, {info['cpu_model']}, {info['mem_gib']:.0f} GiB RAM, "
        f"Linux {info['kernel']}, Python {info['python']}, ckptd {info['ckptd']}; "
        f"load average {' '.join(map(str, info['loadavg_start']))} at start, "
        f"{' '.join(map(str, info.get('loadavg_end', [])))} at end; {info['date']}.",
        "",
        f"Daemon settings: poll_interval_seconds = {options.effective_poll:g}"
        f"{' (default)' if options.poll_interval is None else ' (--poll-interval)'}, "
        f"settle_seconds = {options.effective_settle:g}"
        f"{' (default)' if options.settle_seconds is None else ' (--settle-seconds)'}; "
        f"seed {options.seed}{'; --quick' if options.quick else ''}.",
    ]


def latency_table(rows: dict[str, dict[str, Any]], options: Options) -> list[str]:
    poll = options.effective_poll
    how = {
        "aws": f"IMDSv2 poll, every {poll:g} s",
        "azure": f"Scheduled Events poll, every {poll:g} s",
        "gcp": "hanging GET on `preempted`; daemon restarted per trial",
        "gcp-maintenance": "hanging GET on `maintenance-event`; one daemon",
    }
    lines = [
        "",
        f"## Notice → trainer signalled (poll_interval_seconds = {poll:g})",
        "",
        "Trigger (the notice appears in the fake) → the trainer's SIGUSR1 handler runs.",
        "",
        "| provider | how the daemon learns of it | signalled | median | p90 | p99 | max | min "
        "| poll period (median / max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for provider, s in rows.items():
        period = s["poll_period_s"]
        lines.append(
            f"| {provider} | {how.get(provider, '')} | {s['signalled']}/{s['trials']} "
            f"| {ms(s['median_s'])} | {ms(s['p90_s'])} | {ms(s['p99_s'])} | {ms(s['max_s'])} "
            f"| {ms(s['min_s'])} | {pair(period['median'], period['max'])} |"
        )
    lines += [
        "",
        "Where the time went, median / max over trials (`→` steps follow `notice_received`; "
        "CPU waits: time runnable without a CPU during the trial, from `/proc/*/schedstat` "
        "and `/proc/pressure/cpu`):",
        "",
        "| provider | " + " | ".join(label for _, label in BREAKDOWN) + " |",
        "| --- | " + " | ".join("---" for _ in BREAKDOWN) + " |",
    ]
    for provider, s in rows.items():
        cells = [
            pair(s["breakdown"][attr]["median"], s["breakdown"][attr]["max"])
            for attr, _ in BREAKDOWN
        ]
        lines.append(f"| {provider} | " + " | ".join(cells) + " |")
    return lines


COMMIT_ROWS: tuple[tuple[str, str, Callable[[float | None], str]], ...] = (
    ("noticed_s", "trigger → daemon noticed (`notice_received`)", ms),
    ("signalled_after_s", "noticed → trainer signalled (daemon)", ms),
    ("trainer_saw_s", "trigger → trainer saw the notice", ms),
    ("save_s", "trainer save: write + fsync", sec),
    ("saved_to_complete_s", "save done → daemon found it complete", sec),
    ("complete_to_committed_s", "complete → committed (upload, verify, manifest)", sec),
    ("notice_to_committed_s", "**notice → committed** (daemon: `notice_received` → commit)", sec),
    ("daemon_committed_s", "**trigger → committed** (daemon log)", sec),
    ("manifest_visible_s", "**trigger → manifest readable** (boto3 here)", sec),
    ("seconds_left_at_commit", "seconds left of the 2-min notice at commit", lambda v: sec(v, 1)),
    ("daemon_cpu_s", "daemon CPU, start → commit (user + system)", sec),
)


def commit_table(trials: list[CommitTrial], options: Options) -> list[str]:
    ok = [t for t in trials if t.error is None]
    size = options.emergency_mib
    modes = {(t.mode, t.dest) for t in trials}
    mode, dest = modes.pop() if len(modes) == 1 else ("", "")
    where = "`file://` on the same disk" if dest == "file" else "loopback SeaweedFS"
    lines = [
        "",
        f"## Notice → committed: {size:g} MiB HF-shaped emergency checkpoint, AWS fake, "
        f"{where}, mode {mode} (ship_early = {str(MODE_SETTINGS[mode][0]).lower()}, "
        f"trainer reports its save: {'yes' if MODE_SETTINGS[mode][1] else 'no'})",
        "",
        "| step | " + " | ".join(f"trial {t.trial + 1}" for t in trials) + " | median |",
        "| --- | " + " | ".join("---" for _ in trials) + " | --- |",
    ]
    for attr, label, fmt in COMMIT_ROWS:
        values = [getattr(t, attr) for t in trials]
        lines.append(
            f"| {label} | "
            + " | ".join(fmt(v) for v in values)
            + f" | {fmt(median([getattr(t, attr) for t in ok]))} |"
        )

    def rate(t: CommitTrial, attr: str) -> float | None:
        seconds = getattr(t, attr)
        return t.bytes / MIB / seconds if seconds else None

    def cpu_per_gib(t: CommitTrial) -> float | None:
        return t.daemon_cpu_s / (t.bytes / MIB / 1024) if t.daemon_cpu_s and t.bytes else None

    lines.append(
        "| daemon CPU-s per GiB | "
        + " | ".join("-" if (v := cpu_per_gib(t)) is None else f"{v:.2f}" for t in trials)
        + f" | {sec(median([cpu_per_gib(t) for t in ok]))} |"
    )
    for attr, label in (
        ("save_s", "trainer save MiB/s"),
        ("complete_to_committed_s", "upload MiB/s (complete → committed)"),
    ):
        values = [rate(t, attr) for t in trials]
        med = median([rate(t, attr) for t in ok])
        lines.append(
            f"| {label} | "
            + " | ".join("-" if v is None else f"{v:.0f}" for v in values)
            + f" | {'-' if med is None else f'{med:.0f}'} |"
        )
    lines.append(
        "| committed before the deadline | "
        + " | ".join(
            "-" if t.committed_before_deadline is None else str(t.committed_before_deadline).lower()
            for t in trials
        )
        + " | |"
    )
    for t in trials:
        if t.error:
            lines.append(f"\nTrial {t.trial + 1} failed: {t.error}")
    return lines


def anomalies(per_provider: dict[str, list[LatencyTrial]], options: Options) -> list[str]:
    poll = options.effective_poll
    lines: list[str] = []
    for provider, trials in per_provider.items():
        limit = bound(provider, poll)
        for t in trials:
            if (
                t.error is None
                and t.latency_s is not None
                and t.latency_s <= limit
                and not t.stall_trace
            ):
                continue
            if t.error:
                what = t.error
            elif t.latency_s is not None and t.latency_s > limit:
                what = f"{ms(t.latency_s)} > {ms(limit)}"
            else:
                what = (
                    f"{ms(t.latency_s)}, within the bound, but notice_received → signal "
                    f"{ms(t.notice_to_signal_s)} > {ms(STALL_TRACE_FROM_S)}"
                )
            lines.append(
                f"- {provider} trial {t.trial + 1}: {what}: "
                + ", ".join(f"{label} {ms(getattr(t, attr))}" for attr, label in BREAKDOWN)
                + f", daemon's threads' CPU wait {ms(t.daemon_threads_cpu_wait_s)}"
            )
            lines += [f"      {line}" for line in t.log_excerpt]
            if t.stall_trace:
                lines.append(
                    "      the daemon's threads (state, kernel stack) sampled every 5 ms, "
                    "from notice_received to the signal (if over the bound: from 1.2 poll "
                    "intervals before the trigger):"
                )
                lines += [f"        {line}" for line in t.stall_trace]
        extra = sum(t.extra_signals for t in trials)
        if extra:
            lines.append(f"- {provider}: {extra} signal(s) more than notices")
    if lines:
        return [
            "",
            "### Trials over the bound (and, with --trace-stalls, slow daemon steps)",
            "",
            *lines,
        ]
    return [
        "",
        f"No trial over the bound (poll interval {poll:g} s for aws/azure, 100 ms for gcp).",
    ]


# --- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> tuple[Options, Path | None, Path | None, bool]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--trials", type=int, default=None, help="notice→signal trials per provider (30)"
    )
    p.add_argument("--commit-trials", type=int, default=None, help="notice→committed trials (3)")
    p.add_argument("--emergency-mib", type=float, default=None, help="checkpoint size (1024)")
    p.add_argument(
        "--poll-interval", type=float, default=None, help="override the daemon's default"
    )
    p.add_argument(
        "--settle-seconds", type=float, default=None, help="override the daemon's default"
    )
    p.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS))
    p.add_argument("--phases", default="latency,commit")
    p.add_argument("--quick", action="store_true", help="5 trials, 1 commit trial of 128 MiB")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"commit-trial modes, any of {','.join(MODES)} (module doc)",
    )
    p.add_argument("--dest", default="s3", help="commit-trial destinations: s3 and/or file")
    p.add_argument("--workdir", type=Path, default=None, help="default: a fresh temp dir")
    p.add_argument("--keep", action="store_true", help="keep the work dir (daemon logs)")
    p.add_argument(
        "--trace-stalls",
        action="store_true",
        help="sample the daemon's threads' kernel stacks during latency trials (root)",
    )
    a = p.parse_args(argv)
    providers = tuple(x for x in a.providers.split(",") if x)
    unknown = set(providers) - set(ALL_PROVIDERS)
    if unknown:
        p.error(f"unknown provider(s) {sorted(unknown)}; choose from {list(ALL_PROVIDERS)}")
    phases = tuple(x for x in a.phases.split(",") if x)
    if set(phases) - {"latency", "commit"}:
        p.error("--phases takes latency and/or commit")
    modes = tuple(x for x in a.modes.split(",") if x)
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}")
    dests = tuple(x for x in a.dest.split(",") if x)
    if not dests or set(dests) - {"s3", "file"}:
        p.error("--dest takes s3 and/or file")
    options = Options(
        modes=modes,
        dests=dests,
        trials=a.trials if a.trials is not None else (5 if a.quick else 30),
        commit_trials=a.commit_trials if a.commit_trials is not None else (1 if a.quick else 3),
        emergency_mib=a.emergency_mib
        if a.emergency_mib is not None
        else (128.0 if a.quick else 1024.0),
        poll_interval=a.poll_interval,
        settle_seconds=a.settle_seconds,
        providers=providers,
        phases=phases,
        seed=a.seed,
        quick=a.quick,
        trace_stalls=a.trace_stalls,
    )
    return options, a.json, a.workdir, a.keep


def isolate_environment() -> None:
    """The daemons see only the loopback store's identity, never a real cloud or config."""
    for name in list(os.environ):
        if name.startswith("CKPTD_") or name in (
            "AWS_PROFILE",
            "AWS_SESSION_TOKEN",
            "AWS_CA_BUNDLE",
        ):
            del os.environ[name]
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
    )


@contextlib.contextmanager
def work_directory(given: Path | None, keep: bool) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="bench-preemption-", dir=given))
    else:
        path = Path(tempfile.mkdtemp(prefix="ckptd-bench-preemption-"))
    try:
        yield path
    finally:
        if keep:
            print(f"\n(work dir kept: {path})", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    options, json_path, workdir_arg, keep = parse_args(argv)
    isolate_environment()
    info = machine()
    rng = random.Random(options.seed)
    per_provider: dict[str, list[LatencyTrial]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    commit_trials: list[CommitTrial] = []
    started = time.monotonic()
    with work_directory(workdir_arg, keep) as workdir:
        if "latency" in options.phases:
            for provider in options.providers:
                print(f"[latency] {provider}: {options.trials} trials", file=sys.stderr)
                trials, stats = run_latency(provider, options, workdir, rng)
                per_provider[provider] = trials
                summaries[provider] = latency_summary(trials, stats)
        if "commit" in options.phases and options.commit_trials > 0:
            with LocalS3(workdir / "seaweedfs", buckets=(BUCKET,)) as local_s3:
                s3 = s3_client(local_s3.endpoint_url)
                for i in range(options.commit_trials):
                    for dest, mode in itertools.product(options.dests, options.modes):
                        print(
                            f"[commit] trial {i + 1}/{options.commit_trials}, "
                            f"{options.emergency_mib:g} MiB, {dest}, mode {mode}",
                            file=sys.stderr,
                        )
                        commit_trials.append(
                            run_commit_trial(
                                i, options, workdir, local_s3, s3, rng, mode=mode, dest=dest
                            )
                        )
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    info["bench_wall_s"] = round(time.monotonic() - started, 1)
    lines = header(info, options)
    if summaries:
        lines += latency_table(summaries, options)
        lines += anomalies(per_provider, options)
    for dest, mode in itertools.product(options.dests, options.modes):
        mine = [t for t in commit_trials if (t.mode, t.dest) == (mode, dest)]
        if mine:
            lines += commit_table(mine, options)
    lines += ["", f"Benchmark wall time: {info['bench_wall_s']:.0f} s."]
    print("\n".join(lines))
    if json_path is not None:
        doc = {
            "machine": info,
            "options": asdict(options)
            | {
                "effective_poll_interval_s": options.effective_poll,
                "effective_settle_seconds": options.effective_settle,
            },
            "latency": {
                p: {"summary": summaries[p], "trials": [asdict(t) for t in per_provider[p]]}
                for p in per_provider
            },
            "commit": [asdict(t) for t in commit_trials],
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    failed = any(t.latency_s is None for ts in per_provider.values() for t in ts) or any(
        t.error for t in commit_trials
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
