"""How much a shipping tool slows a trainer on the same node: step-time inflation and the
trainer's page-cache hit rate while a checkpoint ships.

    .venv/bin/python bench/bench_interference.py                       # 1.5 GiB ckpt, 1 GiB dataset, 2 rounds
    .venv/bin/python bench/bench_interference.py --scale 0.5 --runs 1  # quick look
    .venv/bin/python bench/bench_interference.py --tools ckptd,aws --json out.json

The stand-in trainer (``_interference_trainer.py``) reads 4 MiB batches of a dataset file
through the page cache and does ~40 ms of CPU work per batch, recording every step's
time and whether its batch was cached. Pinning (``taskset``): the S3 server on CPU 0,
the trainer and the shipping tool together on CPU 1, so the store's own CPU (elsewhere
in production) is not counted against the tool. Memory: the trainer and the tool run
in one memory cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) of dataset +
``--slack-mib``, the node whose page cache cannot hold dataset and checkpoint together;
without a usable memory cgroup the run says so and measures CPU interference alone.

Each round, per tool: a window of the trainer alone, then the tool ships the checkpoint
(its pages dropped from the cache first, as for a checkpoint written long enough ago or
larger than memory), then the trainer re-warms its dataset. A tool's inflation is the
mean step time while it ran over the mean of the alone window just before it (mean:
what the trainer loses in throughput), with the median beside it; hit rate is the mean
fraction of each batch's pages found cached.

Tools: ``none`` (the control: ``sleep 20`` while nothing ships, so its "inflation" is
the machine's own noise), ``ckptd`` (``run --once`` to S3; it lowers its own priority and drops what it
read from the page cache), ``aws`` (``aws s3 cp --recursive``), ``rclone`` (``rclone
copy``), and for a ``file://`` destination on the same disk ``ckptd-file`` and
``rsync`` (``rsync -a`` + ``sync -f``). A tool that is not installed is reported as
such.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common

from common import (
    BENCH_DIR,
    BUCKET,
    GIB,
    MIB,
    ckptd_command,
    delete_prefix,
    find_peer_binaries,
    fmt,
    hf_shape,
    machine_line,
    rclone_env,
    snapshot_ckptd,
    vacuum,
    weed_master_port,
    workdir,
    write_shape,
)

from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY, LocalS3

TRAINER = BENCH_DIR / "_interference_trainer.py"
TOOLS = ("none", "ckptd", "aws", "rclone", "ckptd-file", "rsync")
SERVER_CPU, TRAINER_CPU = 0, 1


# --- a memory cgroup for the trainer and the tool -------------------------------------


@dataclass
class MemoryCgroup:
    path: Path
    version: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def make_memory_cgroup(limit: int) -> MemoryCgroup | None:
    """A child of this process's memory cgroup limited to ``limit`` bytes, or None."""
    name = f"ckptd-bench-{os.getpid()}"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        ident, controllers, rel = line.split(":", 2)
        try:
            if "memory" in controllers.split(","):
                path = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / name
                path.mkdir()
                (path / "memory.limit_in_bytes").write_text(str(limit))
                return MemoryCgroup(path, 1)
            if ident == "0":
                base = Path("/sys/fs/cgroup") / rel.lstrip("/")
                if "memory" in (base / "cgroup.controllers").read_text().split():
                    path = base / name
                    path.mkdir()
                    (path / "memory.max").write_text(str(limit))
                    return MemoryCgroup(path, 2)
        except OSError:
            continue
    return None


def confined(cmd: list[str], cgroup: MemoryCgroup | None, cpu: int) -> list[str]:
    """``cmd`` started inside ``cgroup`` and pinned to ``cpu``."""
    pinned = ["taskset", "-c", str(cpu), *cmd]
    if cgroup is None:
        return pinned
    return ["sh", "-c", f'echo $$ > "{cgroup.procs}" && exec "$@"', "sh", *pinned]


def drop_from_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --- the trainer's record ---------------------------------------------------------------


def read_steps(path: Path) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # the line being written
        if "dt" in doc:
            out.append(doc)
    return out


def window(steps: list[dict[str, float]], start: float, end: float) -> list[dict[str, float]]:
    return [s for s in steps if start <= s["t"] and s["t"] + s["dt"] <= end]


def wait_warm(path: Path, batches: int, timeout: float = 120.0) -> None:
    """Until the trainer's last epoch's worth of steps all hit the page cache."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = read_steps(path)[-batches:]
        if len(steps) >= batches and min(s["hit"] for s in steps) >= 0.999:
            return
        time.sleep(1)
    print("  (the dataset did not come back fully cached within the timeout)", flush=True)


# --- one run of one tool -----------------------------------------------------------------


@dataclass
class Run:
    tool: str
    round: int
    wall_s: float
    rc: int
    alone_mean_s: float
    alone_median_s: float
    during_mean_s: float
    during_median_s: float
    hit_alone: float
    hit_during: float
    steps_during: int
    error: str | None = None
    tool_cpu_s: float = 0.0
    # The trainer's time runnable but waiting for its CPU, per second of wall time (its
    # /proc/<pid>/schedstat): what took its core, the tool or anything else.
    trainer_wait_alone: float | None = None
    trainer_wait_during: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def inflation(self) -> float:
        return self.during_mean_s / self.alone_mean_s - 1

    @property
    def lost_s(self) -> float:
        """Trainer time lost while the tool ran: its steps' excess over the alone mean."""
        return self.steps_during * (self.during_mean_s - self.alone_mean_s)

    @property
    def median_inflation(self) -> float:
        return self.during_median_s / self.alone_median_s - 1


@dataclass
class Bench:
    work: Path
    server: LocalS3
    watch: Path
    ckpt: Path
    cgroup: MemoryCgroup | None
    ckptd_src: Path
    bins: dict[str, str]
    env: dict[str, str]
    ckptd_toml: str = ""  # extra TOML for ckptd (--ckptd-toml), e.g. a [resources] table
    none_s: float = 20.0  # how long the "none" control window lasts

    def command(self, tool: str, unique: str) -> list[str]:
        url = self.server.endpoint_url
        if tool in ("ckptd", "ckptd-file"):
            dest = f"s3://{BUCKET}/{unique}" if tool == "ckptd" else f"file://{self.work / unique}"
            config = self.work / "ckptd.toml"
            config.write_text(f'[preemption]\nprovider = "none"\n{self.ckptd_toml}')
            return [
                *ckptd_command(self.ckptd_src),
                "run",
                "--once",
                "--watch",
                str(self.watch),
                "--dest",
                dest,
                *(["--endpoint-url", url] if tool == "ckptd" else []),
                "--state-dir",
                str(self.work / "state" / unique),
                "--config",
                str(config),
            ]
        if tool == "aws":
            return [
                self.bins["aws"],
                "s3",
                "cp",
                "--recursive",
                "--no-progress",
                "--only-show-errors",
                str(self.ckpt),
                f"s3://{BUCKET}/{unique}/",
                "--endpoint-url",
                url,
            ]
        if tool == "none":
            # The control: nothing ships; what "inflation" it shows is the machine's noise.
            return ["sleep", str(self.none_s)]
        if tool == "rclone":
            return [self.bins["rclone"], "copy", str(self.ckpt), f"sw:{BUCKET}/{unique}"]
        if tool == "rsync":
            dest = self.work / unique
            return [
                "sh",
                "-c",
                f'mkdir -p "{dest}" && rsync -a "{self.ckpt}" "{dest}/" && sync -f "{dest}"',
            ]
        raise ValueError(tool)

    def tool_env(self, tool: str) -> dict[str, str]:
        if tool == "rclone":
            return rclone_env(self.env, self.server.endpoint_url, self.work)
        return dict(self.env)

    def cleanup(self, tool: str, unique: str) -> None:
        if tool == "none":
            return
        if tool in ("ckptd-file", "rsync"):
            shutil.rmtree(self.work / unique, ignore_errors=True)
        else:
            client = boto3.client(
                "s3",
                endpoint_url=self.server.endpoint_url,
                aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY,
                region_name="us-east-1",
            )
            delete_prefix(client, unique)
            port = weed_master_port(self.server.process.pid) if self.server.process else None
            if port:
                vacuum(port)
        shutil.rmtree(self.work / "state" / unique, ignore_errors=True)
        subprocess.run(["sync"], check=False)


def run_queue_wait_s(pid: int) -> float | None:
    """Seconds process ``pid`` has spent runnable but waiting for a CPU (schedstat)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def wait_rate(before: float | None, after: float | None, seconds: float) -> float | None:
    return None if before is None or after is None or seconds <= 0 else (after - before) / seconds


def run_tool(
    bench: Bench, tool: str, rnd: int, steps_path: Path, alone_s: float, trainer_pid: int
) -> Run:
    unique = f"{tool}-{rnd}-{uuid.uuid4().hex[:6]}"
    drop_from_cache(bench.ckpt)
    alone_start = time.time()
    wait_0 = run_queue_wait_s(trainer_pid)
    time.sleep(alone_s)
    alone_end = time.time()
    wait_1 = run_queue_wait_s(trainer_pid)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    done = subprocess.run(
        confined(bench.command(tool, unique), bench.cgroup, TRAINER_CPU),
        env=bench.tool_env(tool),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    ended = time.time()
    wait_2 = run_queue_wait_s(trainer_pid)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Only the tool was reaped meanwhile (the trainer runs on): this is the tool's CPU.
    tool_cpu = (children.ru_utime - children_before.ru_utime) + (
        children.ru_stime - children_before.ru_stime
    )
    time.sleep(0.5)  # the step in flight at the end is recorded
    steps = read_steps(steps_path)
    alone, during = window(steps, alone_start, alone_end), window(steps, started, ended)
    error = None if done.returncode == 0 else (done.stderr or done.stdout)[-500:]
    if not during:
        error = error or "no complete trainer step while the tool ran"
        during = alone
    run = Run(
        trainer_wait_alone=wait_rate(wait_0, wait_1, alone_end - alone_start),
        trainer_wait_during=wait_rate(wait_1, wait_2, ended - started),
        tool=tool,
        round=rnd,
        wall_s=ended - started,
        rc=done.returncode,
        alone_mean_s=statistics.mean(s["dt"] for s in alone),
        alone_median_s=statistics.median(s["dt"] for s in alone),
        during_mean_s=statistics.mean(s["dt"] for s in during),
        during_median_s=statistics.median(s["dt"] for s in during),
        hit_alone=statistics.mean(s["hit"] for s in alone),
        hit_during=statistics.mean(s["hit"] for s in during),
        steps_during=len(during),
        error=error,
        tool_cpu_s=tool_cpu,
    )
    bench.cleanup(tool, unique)
    return run


@contextmanager
def trainer(
    work: Path, dataset: Path, cgroup: MemoryCgroup | None, work_ms: float
) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    steps, stop = work / "steps.jsonl", work / "trainer.stop"
    stop.unlink(missing_ok=True)
    cmd = [sys.executable, str(TRAINER), "--dataset", str(dataset), "--out", str(steps)]
    cmd += ["--stop", str(stop), "--work-ms", str(work_ms)]
    proc = subprocess.Popen(confined(cmd, cgroup, TRAINER_CPU))
    try:
        yield steps, proc
    finally:
        stop.touch()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_dataset(path: Path, size: int) -> None:
    with path.open("wb") as fh:
        left = size
        while left:
            n = min(64 * MIB, left)
            fh.write(os.urandom(n))
            left -= n
        fh.flush()
        os.fsync(fh.fileno())


def share(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{statistics.median(present):.1%}" if present else "n/a"


def report(runs: list[Run], header: str) -> str:
    lines = [header, ""]
    lines.append(
        "| tool | wall s | tool CPU s | step alone ms | step while shipping ms | "
        "inflation (mean) | inflation (median) | trainer time lost s | "
        "page-cache hit alone | hit while shipping | trainer's CPU wait alone / shipping |"
    )
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    by_tool: dict[str, list[Run]] = {}
    for r in runs:
        by_tool.setdefault(r.tool, []).append(r)
    for tool, rs in by_tool.items():
        ok = [r for r in rs if r.error is None]
        if not ok:
            lines.append(f"| {tool} | failed: {rs[0].error} | | | | | | | | | |")
            continue

        def med(values: list[float]) -> float:
            return statistics.median(values)

        lines.append(
            f"| {tool} | {fmt(med([r.wall_s for r in ok]), '.1f')} "
            f"| {fmt(med([r.tool_cpu_s for r in ok]), '.1f')} "
            f"| {fmt(med([r.alone_mean_s for r in ok]) * 1000, '.1f')} "
            f"| {fmt(med([r.during_mean_s for r in ok]) * 1000, '.1f')} "
            f"| {med([r.inflation for r in ok]):+.1%} "
            f"| {med([r.median_inflation for r in ok]):+.1%} "
            f"| {med([r.lost_s for r in ok]):.1f} "
            f"| {med([r.hit_alone for r in ok]):.1%} "
            f"| {med([r.hit_during for r in ok]):.1%} "
            f"| {share([r.trainer_wait_alone for r in ok])} / "
            f"{share([r.trainer_wait_during for r in ok])} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="checkpoint 1.5 GiB x this")
    parser.add_argument("--dataset-gib", type=float, default=1.0)
    parser.add_argument("--slack-mib", type=int, default=640, help="cgroup limit = dataset + this")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--alone-s", type=float, default=10.0)
    parser.add_argument("--work-ms", type=float, default=40.0)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument(
        "--ckptd-toml", default="", help='extra ckptd config, e.g. "[resources]\\nnice = 19"'
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        print("needs 2 CPUs (server on one, trainer + tool on the other)", file=sys.stderr)
        return 2
    tools = [t for t in args.tools.split(",") if t]
    bins = find_peer_binaries(tools)
    missing = [t for t in tools if t in ("aws", "rclone") and t not in bins]
    if "rsync" in tools and shutil.which("rsync") is None:
        missing.append("rsync")
    tools = [t for t in tools if t not in missing]

    with workdir(args.workdir, args.keep, prefix="ckptd-interference-") as work:
        ckptd_src, digest = snapshot_ckptd(work / "ckptd-src")
        dataset = work / "dataset.bin"
        dataset_bytes = int(args.dataset_gib * GIB)
        write_dataset(dataset, dataset_bytes)
        watch, ckpt = write_shape(work, hf_shape(args.scale))
        drop_from_cache(work)
        cgroup = make_memory_cgroup(dataset_bytes + args.slack_mib * MIB)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
        env |= {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        server = LocalS3(work / "seaweedfs", buckets=(BUCKET,)).start()
        try:
            assert server.process is not None
            subprocess.run(
                ["taskset", "-a", "-p", "-c", str(SERVER_CPU), str(server.process.pid)],
                check=True,
                capture_output=True,
            )
            bench = Bench(
                work,
                server,
                watch,
                ckpt,
                cgroup,
                ckptd_src,
                bins,
                env,
                args.ckptd_toml.replace("\\n", "\n"),
            )
            memory = (
                f"memory cgroup v{cgroup.version} limit {(dataset_bytes + args.slack_mib * MIB) / GIB:.2f} GiB"
                if cgroup
                else "no memory cgroup (CPU interference only)"
            )
            header = (
                f"bench_interference: checkpoint {hf_shape(args.scale).total_bytes / GIB:.2f} GiB, "
                f"dataset {dataset_bytes / GIB:.2f} GiB, {memory}; server on CPU {SERVER_CPU}, "
                f"trainer + tool on CPU {TRAINER_CPU}; ckptd {digest}\n{machine_line()}"
                + (f"\nnot installed: {', '.join(missing)}" if missing else "")
            )
            print(header, flush=True)
            runs: list[Run] = []
            with trainer(work, dataset, cgroup, args.work_ms) as (steps_path, proc):
                batches = dataset_bytes // (4 * MIB)
                wait_warm(steps_path, batches, timeout=300)
                for rnd in range(args.runs):
                    for tool in tools:
                        run = run_tool(bench, tool, rnd, steps_path, args.alone_s, proc.pid)
                        runs.append(run)
                        print(
                            f"  {tool} round {rnd}: {run.wall_s:.1f}s ({run.tool_cpu_s:.1f} CPU-s), inflation "
                            f"{run.inflation:+.1%} (median {run.median_inflation:+.1%}), hit "
                            f"{run.hit_alone:.1%} -> {run.hit_during:.1%}, trainer's CPU wait "
                            f"{share([run.trainer_wait_alone])} -> "
                            f"{share([run.trainer_wait_during])}"
                            + (f" ERROR {run.error}" if run.error else ""),
                            flush=True,
                        )
                        wait_warm(steps_path, batches)
        finally:
            server.stop()
            if cgroup is not None:
                cgroup.remove()
        print()
        print(report(runs, header))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {
                        "header": header,
                        "runs": [
                            r.__dict__
                            | {
                                "inflation": r.inflation,
                                "median_inflation": r.median_inflation,
                                "lost_s": r.lost_s,
                            }
                            for r in runs
                        ],
                    },
                    indent=2,
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
