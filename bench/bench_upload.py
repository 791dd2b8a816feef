"""Upload the same checkpoints with ckptd, the AWS CLI, rclone and s5cmd, and compare.

    .venv/bin/python bench/bench_upload.py [--scale 1.0] [--runs 3] [--json FILE]
        [--tools ckptd,aws,rclone,s5cmd,boto3,socket] [--shapes hf,dcp] [--profile DIR]
        [--saving on,off] [--save-mib-per-s 200]

One loopback SeaweedFS (``ckptd.devtools.locals3``) is started for the whole run and stopped at
the end. Each tool uploads each checkpoint shape ``--runs`` times; every run is a fresh
process under ``bench/_measure.py`` (wall time, CPU of its process tree, peak RSS), and
the server's own CPU is read from /proc around it so the two are never mixed. After each
run the objects are listed (every file there, with its size, or the run counts as
failed), then deleted; SeaweedFS is vacuumed and the disk synced between rounds so one
run's write-back does not land in the next one's time.

What "ckptd" measures: ``ckptd run --once`` on a checkpoint that is already complete (its
quiet window already passed), from process start to exit, and separately the time from
its ``checkpoint_complete`` to its ``checkpoint_committed`` log event: upload, the
store's checksums checked, manifest written. Process wall includes interpreter and
boto3 start-up, as does the AWS CLI's.

While saving (``--saving on,off``, the default; ``--saving ''`` skips it): a
``ckptd run`` daemon watches an empty dir while this process writes the shape into it as
a trainer does (file by file in the shape's order, the commit record last, each fsynced;
paced at ``--save-mib-per-s``, 200 by default, about what the emergency trainer of
``bench_preemption.py`` writes), once with ``[[watch]] ship_early`` on and once off. It
times the daemon's ``checkpoint_complete`` -> ``checkpoint_committed``, the last file
written -> committed, and the daemon's CPU from ready to committed per GiB.

Two references bound what is possible here: plain boto3 (``_boto3_upload.py``: s3transfer
with ckptd's part size and concurrency) and a raw TCP copy over 127.0.0.1
(``_socket_copy.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common

from common import (
    BENCH_DIR,
    BUCKET,
    GIB,
    MIB,
    PEERS,
    Shape,
    ToolRun,
    ckptd_command,
    command_version,
    dcp_shape,
    delete_prefix,
    dir_size,
    event_time,
    find_peer_binaries,
    fmt,
    hf_shape,
    list_prefix,
    log_events,
    loopback_limit_line,
    machine_line,
    measure,
    median_of,
    proc_cpu_seconds,
    ratio,
    rclone_env,
    seconds_between,
    server_floor_s,
    snapshot_ckptd,
    source_digest,
    tail,
    vacuum,
    wait_until_older,
    weed_master_port,
    which,
    workdir,
    write_shape,
)

from ckptd.devtools.locals3 import LocalS3

VENV_BIN = Path(sys.executable).parent
ALL_TOOLS = ("ckptd", "aws", "rclone", "s5cmd", "boto3", "socket")
LABELS = {
    "ckptd": "ckptd (process)",
    "ckptd-commit": "ckptd (complete→committed)",
    "aws": "aws s3 cp --recursive",
    "rclone": "rclone copy",
    "s5cmd": "s5cmd cp",
    "boto3": "ref: boto3 s3transfer",
    "socket": "ref: TCP sendfile 127.0.0.1",
}


@dataclass
class Job:
    """One tool's command for one shape, and where its objects should end up."""

    cmd: list[str]
    env: dict[str, str]
    prefix: str | None  # key prefix holding the checkpoint's files; None: nothing stored
    extra_keys: tuple[str, ...] = ()  # objects the tool adds beside the files


@dataclass
class Bench:
    """Everything a run needs: the server, the data, the tools."""

    work: Path
    server: LocalS3
    base_env: dict[str, str]
    part_size_mib: int
    concurrency: int
    ckptd_config: Path | None
    ckptd_src: Path | None  # a snapshot of ckptd's sources; None: the installed tree
    ckptd_digest: str = ""
    bins: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.endpoint_url

    def ckptd_config_file(self) -> Path:
        if self.ckptd_config is not None:
            return self.ckptd_config
        path = self.work / "ckptd.toml"
        path.write_text(
            "[destination]\n"
            f"part_size_mib = {self.part_size_mib}\n"
            f"concurrency = {self.concurrency}\n"
        )
        return path

    def job(self, tool: str, shape: Shape, watch: Path, ckpt: Path, unique: str) -> Job:
        env = dict(self.base_env)
        if tool == "ckptd":
            state = self.work / "state" / unique
            return Job(
                [
                    *ckptd_command(self.ckptd_src),
                    "run",
                    "--once",
                    "--watch",
                    str(watch),
                    "--dest",
                    f"s3://{BUCKET}/{unique}",
                    "--endpoint-url",
                    self.url,
                    "--state-dir",
                    str(state),
                    "--config",
                    str(self.ckptd_config_file()),
                ],
                env,
                # <url>/<run_id>/<checkpoint>/...; run_id is the watch dir's basename.
                f"{unique}/{watch.name}/{shape.checkpoint}",
                ("ckptd.manifest.json",),
            )
        if tool == "aws":
            return Job(
                [
                    self.bins["aws"],
                    "s3",
                    "cp",
                    "--recursive",
                    "--no-progress",
                    str(ckpt),
                    f"s3://{BUCKET}/{unique}/",
                    "--endpoint-url",
                    self.url,
                ],
                env,
                unique,
            )
        if tool == "rclone":
            env = rclone_env(env, self.url, self.work, provider="Other")
            return Job(
                [self.bins["rclone"], "copy", str(ckpt), f"sw:{BUCKET}/{unique}"], env, unique
            )
        if tool == "s5cmd":
            return Job(
                [
                    self.bins["s5cmd"],
                    "--endpoint-url",
                    self.url,
                    "cp",
                    f"{ckpt}/*",  # s5cmd expands the wildcard itself
                    f"s3://{BUCKET}/{unique}/",
                ],
                env,
                unique,
            )
        if tool == "boto3":
            return Job(
                [
                    sys.executable,
                    str(BENCH_DIR / "_boto3_upload.py"),
                    "--endpoint-url",
                    self.url,
                    "--bucket",
                    BUCKET,
                    "--prefix",
                    unique,
                    "--part-size-mib",
                    str(self.part_size_mib),
                    "--concurrency",
                    str(self.concurrency),
                    str(ckpt),
                ],
                env,
                unique,
            )
        if tool == "socket":
            return Job([sys.executable, str(BENCH_DIR / "_socket_copy.py"), str(ckpt)], env, None)
        raise ValueError(f"unknown tool {tool!r}")


# --- the store, from this process ---------------------------------------------------------


def s3_client(bench: Bench) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=bench.url,
        aws_access_key_id=bench.base_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=bench.base_env["AWS_SECRET_ACCESS_KEY"],
        region_name=bench.base_env.get("AWS_DEFAULT_REGION", "us-east-1"),
    )


def check_upload(client: Any, job: Job, shape: Shape) -> str | None:
    """None if every file is in the store with its size; else what is wrong."""
    if job.prefix is None:
        return None
    found = list_prefix(client, job.prefix + "/")
    problems: list[str] = []
    for rel, size in shape.files:
        key = f"{job.prefix}/{rel}"
        if key not in found:
            problems.append(f"missing {rel}")
        elif found[key] != size:
            problems.append(f"{rel}: {found[key]} bytes, expected {size}")
    for rel in job.extra_keys:
        if f"{job.prefix}/{rel}" not in found:
            problems.append(f"missing {rel}")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return "; ".join(problems[:3]) + more
    return None


# --- running -----------------------------------------------------------------------------------


@dataclass
class Result(ToolRun):
    commit_s: float | None = None  # ckptd only: checkpoint_complete -> checkpoint_committed
    commit_cpu_s: float | None = None  # ckptd only: its own CPU over the upload (log field)


def run_one(
    bench: Bench, client: Any, tool: str, shape: Shape, watch: Path, ckpt: Path, run: int
) -> Result:
    unique = f"{tool}-{shape.name}-r{run}-{secrets.token_hex(3)}"
    job = bench.job(tool, shape, watch, ckpt, unique)
    m = measure(
        job.cmd,
        env=job.env,
        log_dir=bench.work / "logs",
        label=unique,
        server_pid=bench.server.process.pid if bench.server.process else None,
    )
    result = Result(tool, shape.name, run, shape.total_bytes, m)
    if m.rc != 0:
        result.error = f"exit {m.rc}: {tail(m.stderr, 5)}"
    else:
        result.error = check_upload(client, job, shape)
    if tool == "ckptd" and m.stderr is not None:
        events = log_events(m.stderr)
        result.commit_s = seconds_between(events, "checkpoint_complete", "checkpoint_committed")
        committed = [e for e in events if e.get("event") == "checkpoint_committed"]
        if committed and committed[-1].get("cpu_seconds") is not None:
            result.commit_cpu_s = float(committed[-1]["cpu_seconds"])
        if result.commit_s is None and result.error is None:
            result.error = "no checkpoint_complete/checkpoint_committed events in its log"
    if job.prefix is not None:
        # Everything the run wrote, including ckptd's LATEST one level up.
        delete_prefix(client, unique + "/")
    # Push this run's writes (the server's volume files) to disk now, so their write-back
    # is not charged to the next run.
    os.sync()
    return result


def settle_store(bench: Bench) -> None:
    """Reclaim deleted objects' space and flush, between rounds (not timed)."""
    pid = bench.server.process.pid if bench.server.process else None
    port = weed_master_port(pid) if pid else None
    if port is not None:
        vacuum(port)
    os.sync()


def warm_up(bench: Bench, client: Any) -> None:
    """First writes make SeaweedFS allocate its volumes; do that before anything is timed."""
    body = os.urandom(16 * MIB)
    for i in range(4):
        client.put_object(Bucket=BUCKET, Key=f"warmup/{i}", Body=body)
    delete_prefix(client, "warmup/")
    settle_store(bench)


@dataclass
class Row:
    label: str
    tool: str
    wall_s: float | None
    best_wall_s: float | None
    mib_s: float | None
    cpu_s: float | None
    cpu_per_gib: float | None
    rss_mib: float | None
    server_per_gib: float | None
    other_cpu_s: float | None
    ok: int
    runs: int
    errors: list[str]


def rows_for(shape: Shape, results: list[Result], tools: Sequence[str]) -> list[Row]:
    gib = shape.total_bytes / GIB
    rows: list[Row] = []
    for tool in tools:
        mine = [r for r in results if r.tool == tool and r.shape == shape.name]
        good = [r for r in mine if r.error is None]
        errors = [r.error for r in mine if r.error]

        def med(get: Callable[[Result], float], pool: list[Result] = good) -> float | None:
            return median_of([get(r) for r in pool])

        wall = med(lambda r: r.m.wall_s)
        best = min((r.m.wall_s for r in good), default=None)
        cpu = med(lambda r: r.m.cpu_s)
        server = med(lambda r: r.m.server_cpu_s)
        rows.append(
            Row(
                LABELS[tool],
                tool,
                wall,
                best,
                shape.total_bytes / MIB / wall if wall else None,
                cpu,
                cpu / gib if cpu is not None else None,
                (med(lambda r: float(r.m.maxrss_kib)) or 0.0) / 1024 if good else None,
                server / gib if server is not None else None,
                med(lambda r: r.m.other_cpu_s),
                len(good),
                len(mine),
                errors,
            )
        )
        if tool == "ckptd":
            commits = [r.commit_s for r in good if r.commit_s is not None]
            commit = median_of(commits)
            commit_cpu = median_of([r.commit_cpu_s for r in good if r.commit_cpu_s is not None])
            rows.append(
                Row(
                    LABELS["ckptd-commit"],
                    "ckptd-commit",
                    commit,
                    min(commits, default=None),
                    shape.total_bytes / MIB / commit if commit else None,
                    commit_cpu,
                    commit_cpu / gib if commit_cpu is not None else None,
                    None,
                    None,
                    None,
                    len(good),
                    len(mine),
                    [],
                )
            )
    return rows


def render_shape(shape: Shape, rows: list[Row]) -> list[str]:
    by_tool = {r.tool: r for r in rows}
    ckptd = by_tool.get("ckptd")
    ckptd_wall = ckptd.wall_s if ckptd else None
    ckptd_cpu = ckptd.cpu_per_gib if ckptd else None
    files = len(shape.files)
    lines = [
        f"### {shape.name}: `{shape.checkpoint}/`, {files} files, "
        f"{shape.total_bytes / MIB:.1f} MiB",
        "",
        "| tool | wall s | min wall s | MiB/s | client CPU s | client CPU s/GiB | peak RSS MiB "
        "| server CPU s/GiB | other CPU s | wall ÷ ckptd wall | ckptd CPU/GiB ÷ this | ok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {fmt(r.wall_s)} | {fmt(r.best_wall_s)} | {fmt(r.mib_s, '.0f')} | {fmt(r.cpu_s)} "
            f"| {fmt(r.cpu_per_gib)} | {fmt(r.rss_mib, '.0f')} | {fmt(r.server_per_gib)} "
            f"| {fmt(r.other_cpu_s, '.1f')} "
            f"| {fmt(None if r.tool.startswith('ckptd') else ratio(r.wall_s, ckptd_wall))} "
            f"| {fmt(None if r.tool.startswith('ckptd') else ratio(ckptd_cpu, r.cpu_per_gib))} "
            f"| {r.ok}/{r.runs} |"
        )
    peers = [by_tool[t] for t in PEERS if t in by_tool and by_tool[t].wall_s is not None]
    lines.append("")
    if ckptd is not None and ckptd.wall_s is not None and peers:
        best = min(peers, key=lambda r: r.wall_s or float("inf"))
        commit = by_tool["ckptd-commit"].wall_s
        lines.append(
            f"- best peer: {best.label}, {fmt(best.wall_s)} s. best-peer wall ÷ ckptd wall = "
            f"{fmt(ratio(best.wall_s, ckptd.wall_s))} (process), "
            f"{fmt(ratio(best.wall_s, commit))} (complete→committed); above 1 = ckptd faster."
        )
        aws = by_tool.get("aws")
        if aws is not None and aws.cpu_per_gib:
            upload_cpu = by_tool["ckptd-commit"].cpu_per_gib
            lines.append(
                f"- ckptd client CPU/GiB ÷ aws CPU/GiB = {fmt(ratio(ckptd.cpu_per_gib, aws.cpu_per_gib))}"
                f" (process), {fmt(ratio(upload_cpu, aws.cpu_per_gib))} (complete→committed,"
                " the daemon's steady cost); below 1 = ckptd uses less CPU."
            )
    # The server's CPU/GiB under ckptd and the peers; the references (boto3, the TCP copy,
    # which the server does not even see) are left out.
    floor = server_floor_s(
        [r.server_per_gib for r in rows if r.tool in ("ckptd", *PEERS)], shape.total_bytes
    )
    if floor is not None:
        commit = by_tool["ckptd-commit"].wall_s if "ckptd-commit" in by_tool else None
        best_wall = min((p.wall_s for p in peers if p.wall_s is not None), default=None)
        lines.append(
            loopback_limit_line(
                floor, [("ckptd complete→committed", commit), ("best peer", best_wall)]
            )
        )
    for r in rows:
        for err in dict.fromkeys(r.errors):
            lines.append(f"- {r.label} failed: {err}")
    lines.append("")
    return lines


def header(
    machine: str, versions: dict[str, str], args: argparse.Namespace, bench: Bench
) -> list[str]:
    tools = ", ".join(f"{k} {v}" for k, v in versions.items())
    return [
        "## Checkpoint upload to loopback SeaweedFS S3",
        "",
        f"Machine: {machine}.",
        f"Versions: {tools}.",
        "",
        f"All tools share these CPUs with the SeaweedFS server (`weed mini`) on the same "
        f"machine; scale {args.scale}, median of {args.runs} run(s); the data (random bytes) "
        "is in the page cache (written and fsynced before timing, not dropped); SeaweedFS "
        "writes to the page cache and does not fsync. MiB/s = MiB (2^20 bytes) ÷ wall "
        "seconds (median); min wall = the fastest run, the least disturbed by other load. "
        "Client CPU = user+sys of the tool's whole process tree; server CPU = "
        "user+sys of `weed`, read from /proc; other CPU = the rest of the machine's busy "
        "time during the run (other sessions, kernel threads). ckptd and boto3 ref: "
        f"part size {bench.part_size_mib} MiB, concurrency {bench.concurrency}; peers at "
        "their defaults.",
        "",
    ]


def tool_versions(bench: Bench, tools: Sequence[str]) -> dict[str, str]:
    import boto3
    import botocore

    versions: dict[str, str] = {}
    versions["python"] = sys.version.split()[0]
    if "ckptd" in tools:
        # Also warms the page cache for ckptd's imports before anything is timed.
        versions["ckptd"] = command_version(
            [*ckptd_command(bench.ckptd_src), "--version"], r"(?<=ckptd )\S+"
        )
        if bench.ckptd_src is not None:
            versions["ckptd"] += f" (sources {bench.ckptd_digest}, copied at start)"
        else:
            versions["ckptd"] += " (working tree)"
    versions["boto3"] = boto3.__version__
    versions["botocore"] = botocore.__version__
    if "aws" in tools:
        versions["aws-cli"] = command_version([bench.bins["aws"], "--version"], r"aws-cli/\S+")
    if "rclone" in tools:
        versions["rclone"] = command_version([bench.bins["rclone"], "version"], r"rclone v\S+")
    if "s5cmd" in tools:
        versions["s5cmd"] = command_version([bench.bins["s5cmd"], "version"], r"v\d\S*")
    versions["seaweedfs"] = command_version(
        [str(VENV_BIN / "weed") if (VENV_BIN / "weed").exists() else "weed", "version"],
        r"(?<=version )\S+ \S+",
    )
    return versions


def profile_ckptd(bench: Bench, shapes: list[tuple[Shape, Path, Path]], out_dir: Path) -> list[str]:
    """One extra, untimed ckptd run per shape under py-spy; summarise where samples fall."""
    pyspy = which("py-spy", VENV_BIN)
    if pyspy is None:
        return ["py-spy not found (pip install py-spy); no profile taken.", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["## ckptd profile (py-spy, non-idle samples, all threads)", ""]
    for shape, watch, ckpt in shapes:
        unique = f"profile-{shape.name}-{secrets.token_hex(3)}"
        job = bench.job("ckptd", shape, watch, ckpt, unique)
        raw = out_dir / f"ckptd-{shape.name}.txt"
        # Blocking sampling (the default) pauses the process per sample: slower, but every
        # sample has a readable stack. --gil would miss threads in GIL-free C code.
        cmd = [pyspy, "record", "--subprocesses", "--format", "raw", "-r", "100"]
        cmd += ["-o", str(raw), "--", *job.cmd]
        done = subprocess.run(cmd, env=job.env, capture_output=True, text=True, timeout=1800)
        with contextlib.suppress(Exception):
            delete_prefix(s3_client(bench), unique + "/")
        if done.returncode != 0 or not raw.exists():
            lines += [f"- {shape.name}: py-spy failed: {done.stderr[-500:]}", ""]
            continue
        lines += [f"### {shape.name} ({raw})", "", *summarise_profile(raw), ""]
    return lines


def summarise_profile(raw: Path, top: int = 12) -> list[str]:
    """Top functions by self samples and by inclusive samples, from py-spy's raw output."""
    self_count: dict[str, int] = {}
    incl_count: dict[str, int] = {}
    total = empty = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames:
            empty += count  # no Python frame could be read for this sample
            continue
        total += count
        self_count[frames[-1]] = self_count.get(frames[-1], 0) + count
        for f in set(frames):
            incl_count[f] = incl_count.get(f, 0) + count
    if not total:
        return ["(no samples)"]
    out = [f"{total} samples with a Python stack ({empty} without). Self (leaf) time:", ""]
    for name, n in sorted(self_count.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"- {100 * n / total:5.1f}%  {name}")
    out += ["", "Inclusive time (thread and event-loop plumbing left out):", ""]
    ours = [(k, v) for k, v in incl_count.items() if not k.startswith(_PLUMBING)]
    for name, n in sorted(ours, key=lambda kv: -kv[1])[:top]:
        out.append(f"- {100 * n / total:5.1f}%  {name}")
    return out


# Frames on nearly every stack (thread start, pool worker, asyncio loop, runpy): they
# would crowd out the functions that say where the time goes.
_PLUMBING = (
    "Thread._bootstrap",
    "Thread.run (",
    "_worker (futures/",
    "_WorkItem.run (",
    "run (asyncio/",
    "Runner.run (",
    "BaseEventLoop.run",
    "BaseEventLoop._run_once",
    "Handle._run (",
    "_run_module_as_main",
    "_run_code (",
    "run_module (",
    "with_current_context.",
    "ClientCreator._create_api_method.",
    "<module> (bench/_run_ckptd.py)",
    "main (bench/_run_ckptd.py)",
    "<module> (ckptd/__main__.py)",
)


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``, keeping the package dir."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if parts else path
    return f"{name} ({short})" if where else name


@dataclass
class SavingRun:
    """One checkpoint written while a daemon watches (module doc)."""

    shape: str
    run: int
    ship_early: bool
    save_s: float = 0.0  # this process: first byte -> last file closed
    complete_to_committed_s: float | None = None
    saved_to_committed_s: float | None = None
    early_files: int = 0
    cpu_s: float | None = None  # the daemon, ckptd_ready -> committed
    error: str | None = None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_like_a_trainer(src: Path, dst: Path, shape: Shape, mib_per_s: float) -> None:
    """Copy ``shape``'s files from ``src`` to ``dst`` in order, each fsynced, paced."""
    dst.mkdir(parents=True)
    chunk, started, written = 8 * MIB, time.monotonic(), 0
    for rel, _ in shape.files:
        with (src / rel).open("rb") as fin, (dst / rel).open("wb") as fout:
            while data := fin.read(chunk):
                fout.write(data)
                written += len(data)
                if mib_per_s > 0:
                    ahead = written / MIB / mib_per_s - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
            fout.flush()
            os.fsync(fout.fileno())


def run_saving(
    bench: Bench, client: Any, shape: Shape, src: Path, run: int, early: bool, mib_per_s: float
) -> SavingRun:
    out = SavingRun(shape.name, run, early)
    unique = f"saving-{shape.name}-{run}-{'early' if early else 'late'}-{secrets.token_hex(3)}"
    watch = bench.work / "saving" / unique / shape.name
    watch.mkdir(parents=True)
    config = bench.work / "saving" / unique / "ckptd.toml"
    config.write_text(
        "[[watch]]\n"
        f"dir = {json.dumps(str(watch))}\n"
        f"ship_early = {'true' if early else 'false'}\n"
        "[destination]\n"
        f'url = "s3://{BUCKET}/{unique}"\n'
        f"endpoint_url = {json.dumps(bench.url)}\n"
        f"part_size_mib = {bench.part_size_mib}\n"
        f"concurrency = {bench.concurrency}\n"
        '[preemption]\nprovider = "none"\n'
        f'[metrics]\nlisten = "127.0.0.1:{_free_port()}"\n'
        f"[state]\ndir = {json.dumps(str(watch.parent / 'state'))}\n"
    )
    log = watch.parent / "ckptd.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [*ckptd_command(bench.ckptd_src), "run", "--config", str(config)],
            env=bench.base_env,
            stdout=sink,
            stderr=sink,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "ckptd_ready" for e in log_events(log)):
            if proc.poll() is not None or time.monotonic() > deadline:
                out.error = f"daemon not ready: {tail(log)}"
                return out
            time.sleep(0.05)
        cpu0 = proc_cpu_seconds(proc.pid)
        t0 = time.monotonic()
        _write_like_a_trainer(src, watch / shape.checkpoint, shape, mib_per_s)
        saved_wall = time.time()
        out.save_s = time.monotonic() - t0
        deadline = time.monotonic() + 900
        while not (done := [e for e in log_events(log) if e["event"] == "checkpoint_committed"]):
            if proc.poll() is not None or time.monotonic() > deadline:
                out.error = f"not committed: {tail(log)}"
                return out
            time.sleep(0.02)
        out.cpu_s = proc_cpu_seconds(proc.pid) - cpu0
        events = log_events(log)
        out.complete_to_committed_s = seconds_between(
            events, "checkpoint_complete", "checkpoint_committed"
        )
        out.saved_to_committed_s = event_time(done[0]) - saved_wall
        out.early_files = int(done[0].get("early", 0)) + int(done[0].get("skipped", 0))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        delete_prefix(client, unique + "/")
        shutil.rmtree(watch, ignore_errors=True)
    return out


def render_saving(shapes: list[Shape], runs: list[SavingRun], mib_per_s: float) -> list[str]:
    pace = f"{mib_per_s:g} MiB/s" if mib_per_s > 0 else "as fast as the disk"
    lines = [
        "",
        f"### While the trainer saves (written at {pace}, fsynced, commit record last)",
        "",
        "| shape | ship_early | save | complete → committed | saved → committed "
        "| files sent before complete | daemon CPU-s per GiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape in shapes:
        for early in (True, False):
            mine = [r for r in runs if r.shape == shape.name and r.ship_early == early]
            ok = [r for r in mine if r.error is None]
            if not mine:
                continue
            gib = shape.total_bytes / GIB
            cpu = median_of([r.cpu_s / gib if r.cpu_s is not None else None for r in ok])
            lines.append(
                f"| {shape.name} | {'on' if early else 'off'} "
                f"| {fmt(median_of([r.save_s for r in ok]))} s "
                f"| {fmt(median_of([r.complete_to_committed_s for r in ok]))} s "
                f"| {fmt(median_of([r.saved_to_committed_s for r in ok]))} s "
                f"| {median_of([float(r.early_files) for r in ok]) or 0:.0f}/{len(shape.files)} "
                f"| {fmt(cpu)} |"
            )
    failed = [r for r in runs if r.error]
    lines += [
        f"\n{r.shape} run {r.run} ship_early={r.ship_early} failed: {r.error}" for r in failed
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply data sizes")
    parser.add_argument("--runs", type=int, default=3, help="runs per tool and shape (median)")
    parser.add_argument("--tools", default=",".join(ALL_TOOLS))
    parser.add_argument("--shapes", default="hf,dcp")
    parser.add_argument("--json", type=Path, default=None, help="also write all runs here")
    parser.add_argument("--part-size-mib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--ckptd-config", type=Path, default=None, help="TOML for ckptd instead of the default"
    )
    parser.add_argument(
        "--ckptd-src",
        type=Path,
        default=None,
        help="run ckptd from DIR/ckptd (e.g. a kept work dir's ckptd-src), to compare "
        "settings on exactly the same code",
    )
    parser.add_argument(
        "--ckptd-from-tree",
        action="store_true",
        help="run ckptd from the working tree, not from a copy taken at start",
    )
    parser.add_argument(
        "--saving",
        default="on,off",
        help="ship_early modes of the while-saving runs (on,off); '' skips them",
    )
    parser.add_argument(
        "--save-mib-per-s",
        type=float,
        default=200.0,
        help="pace of the while-saving writes (0: as fast as the disk)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (data, logs)")
    parser.add_argument(
        "--profile", type=Path, default=None, help="after timing, profile ckptd with py-spy here"
    )
    args = parser.parse_args(argv)

    tools = [t for t in args.tools.split(",") if t]
    unknown = set(tools) - set(ALL_TOOLS)
    if unknown:
        parser.error(f"unknown tools: {', '.join(sorted(unknown))}")
    makers = {"hf": hf_shape, "dcp": dcp_shape}
    shape_names = [s for s in args.shapes.split(",") if s]
    if set(shape_names) - set(makers):
        parser.error(f"shapes are {', '.join(makers)}")

    saving_modes = [m for m in args.saving.split(",") if m]
    if set(saving_modes) - {"on", "off"}:
        parser.error("--saving takes on and/or off")

    bins = find_peer_binaries(tools)
    missing = [t for t in tools if t in PEERS and t not in bins]
    for tool in missing:
        print(f"warning: {tool} not found, skipped", file=sys.stderr)
    tools = [t for t in tools if t not in missing]

    machine = machine_line()  # before anything of ours loads the machine
    with workdir(args.workdir, args.keep) as work:
        print(f"work dir: {work}", file=sys.stderr)
        shapes: list[tuple[Shape, Path, Path]] = []
        t0 = time.monotonic()
        for name in shape_names:
            shape = makers[name](args.scale)
            watch, ckpt = write_shape(work / "data", shape)
            shapes.append((shape, watch, ckpt))
        print(f"data written in {time.monotonic() - t0:.1f}s", file=sys.stderr)

        ckptd_src, ckptd_digest = None, ""
        if args.ckptd_src is not None:
            ckptd_src, ckptd_digest = args.ckptd_src.absolute(), source_digest(args.ckptd_src)
        elif ("ckptd" in tools or saving_modes) and not args.ckptd_from_tree:
            ckptd_src, ckptd_digest = snapshot_ckptd(work / "ckptd-src")
        server = LocalS3(work / "seaweedfs").start()
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
            env.update(server.env())
            # Keep every AWS SDK away from a user's ~/.aws (concurrency, part size, retries).
            env["AWS_CONFIG_FILE"] = str(work / "aws-config-none")
            env["AWS_SHARED_CREDENTIALS_FILE"] = str(work / "aws-credentials-none")
            bench = Bench(
                work,
                server,
                env,
                args.part_size_mib,
                args.concurrency,
                args.ckptd_config,
                ckptd_src,
                ckptd_digest,
                bins,
            )
            client = s3_client(bench)
            versions = tool_versions(bench, tools)
            warm_up(bench, client)
            # Past ckptd's quiet window (settle_seconds, 2 s by default), so the rule's wait
            # is not timed as upload work.
            wait_until_older([c / rel for s, _, c in shapes for rel, _ in s.files], 3.0)

            results: list[Result] = []
            for run in range(1, args.runs + 1):
                for shape, watch, ckpt in shapes:
                    for tool in tools:
                        r = run_one(bench, client, tool, shape, watch, ckpt, run)
                        results.append(r)
                        status = "ok" if r.error is None else f"FAILED: {r.error}"
                        extra = f" commit {r.commit_s:.2f}s" if r.commit_s is not None else ""
                        print(
                            f"run {run} {shape.name:<4} {tool:<7} {r.m.wall_s:7.2f}s{extra} "
                            f"cpu {r.m.cpu_s:6.2f}s server {r.m.server_cpu_s:6.2f}s {status}",
                            file=sys.stderr,
                        )
                    settle_store(bench)
            saving: list[SavingRun] = []
            for run in range(1, args.runs + 1):
                for shape, _, ckpt in shapes:
                    for mode in saving_modes:
                        r2 = run_saving(
                            bench, client, shape, ckpt, run, mode == "on", args.save_mib_per_s
                        )
                        saving.append(r2)
                        print(
                            f"saving run {run} {shape.name:<4} ship_early={mode:<3} "
                            f"save {r2.save_s:6.2f}s complete->committed "
                            f"{fmt(r2.complete_to_committed_s)}s cpu {fmt(r2.cpu_s)}s "
                            f"{'ok' if r2.error is None else 'FAILED: ' + r2.error}",
                            file=sys.stderr,
                        )
                    settle_store(bench)
            store_left = dir_size(work / "seaweedfs")

            lines = header(machine, versions, args, bench)
            table_tools = [t for t in ALL_TOOLS if t in tools]
            for shape, _, _ in shapes:
                if table_tools:
                    lines += render_shape(shape, rows_for(shape, results, table_tools))
            if saving:
                lines += render_saving([s for s, _, _ in shapes], saving, args.save_mib_per_s)
            if args.profile is not None and "ckptd" in tools:
                lines += profile_ckptd(bench, shapes, args.profile)
        finally:
            server.stop()
        print("\n".join(lines))
        print(f"(SeaweedFS data dir at the end: {store_left / MIB:.0f} MiB)", file=sys.stderr)

        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {
                        "machine": machine,
                        "versions": versions,
                        "scale": args.scale,
                        "runs": args.runs,
                        "part_size_mib": args.part_size_mib,
                        "concurrency": args.concurrency,
                        "shapes": {
                            s.name: {"bytes": s.total_bytes, "files": len(s.files)}
                            for s, _, _ in shapes
                        },
                        "results": [r.as_dict() for r in results],
                        "saving": [asdict(r) for r in saving],
                        "save_mib_per_s": args.save_mib_per_s,
                        "table": lines,
                    },
                    indent=2,
                )
                + "\n"
            )
    failed = sum(1 for r in [*results, *saving] if r.error is not None)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
