"""Many small files: ckptd against the AWS CLI and s5cmd, up and down, and 100,000 files.

    .venv/bin/python bench/bench_manyfiles.py --runs 3 --scale 0 --shapes 3000x64 --tools ckptd,s5cmd   # issue #46's table (docs/benchmarks.md), ~2 min idle
    .venv/bin/python bench/bench_manyfiles.py --runs 3 --scale 0 --shapes 3000x64 --tools ckptd,s5cmd --baseline DIR   # and the ckptd under DIR (another checkout: before/after) side by side
    .venv/bin/python bench/bench_manyfiles.py                       # 3,000 x 64 KiB and 30,000 x 4 KiB, 3 runs, then 100,000 files
    .venv/bin/python bench/bench_manyfiles.py --runs 1 --scale 0     # the two shapes once, no 100,000-file part
    .venv/bin/python bench/bench_manyfiles.py --shapes '' --scale 100000   # the 100,000-file part alone
    .venv/bin/python bench/bench_manyfiles.py --pin --json bench/results/manyfiles.json
    .venv/bin/python bench/bench_manyfiles.py --smoke   # seconds: ckptd alone, 50 files, 200 at scale (CI)

One loopback SeaweedFS (``ckptd.devtools.locals3``) for the whole run. Two DCP-shaped
checkpoints (``__<i>_0.distcp`` shards of random bytes, ``.metadata`` written last,
fsynced, left in the page cache): ``3000x64`` (3,000 shards of 64 KiB, 188 MiB) and
``30000x4`` (30,000 of 4 KiB, 117 MiB). Each round uploads each shape with every tool,
then restores it, in a rotating order, each run a fresh process under ``_measure.py``
(wall, CPU of its process tree, peak RSS; the server's CPU read from /proc apart):

| tool | upload | restore |
| --- | --- | --- |
| ckptd | `ckptd run --once` (and its `checkpoint_complete` -> `checkpoint_committed`, with that span's CPU from its log) | `ckptd restore --latest` (CRC-32C of every byte, made durable before the atomic rename: one `syncfs` on ext4/XFS/Btrfs, else an fsync of every file) |
| AWS CLI | `aws s3 cp --recursive` | `aws s3 cp --recursive` down |
| s5cmd | `s5cmd cp 'DIR/*'` | `s5cmd cp 's3://.../*'` down; also `+ sync -f` (the peers do not fsync) |

An upload counts only if a listing finds every file with its size; a restore only if
the directory holds exactly the files with their sizes (and their bytes, on the first
round). Requests per file: one more, untimed, run of each tool and direction through
the fault proxy (``tests/support/faultproxy.py``), which counts every request; the
table gives all requests ÷ files, and the per-checkpoint requests apart.

``--scale N`` (100,000 by default; 0 skips it): one checkpoint of N files of 4-64 KiB
(seeded sizes) written while a ``ckptd run`` daemon watches (``ship_early`` on, as by
default), ``.metadata`` last: the time from the last file written to committed, the
daemon's peak RSS (VmHWM) and CPU, the manifest's size and the time to build and
serialise it (write) and to parse it (read), in this process; then `ckptd list`,
`ckptd verify --latest` and `ckptd restore --latest` (bytes checked by CRC-32C against
the files written), and a second checkpoint with ``keep_last = 1``: its commit must
delete the first (every one of its N objects gone).

``--pin``: SeaweedFS on CPU 0 and every client on CPU 1 (``taskset``), so a client's
CPU cannot be lent to the server or the other way round. Without it, all share both
cores, as in the issue's first measurement.

The ckptd measured is byte-compiled first (``compileall`` of the package the runs import,
into its ``__pycache__``), as an installed ckptd is (pip compiles on install): a checkout
run with ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile some 250 modules from
source in every timed process, a start-up no install pays. ``--cold-bytecode`` skips it.
The load average is printed with every run and at the end of the table: figures taken
under load are not final.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # and tests.support

from common import (
    BUCKET,
    KIB,
    MIB,
    ToolRun,
    command_version,
    delete_prefix,
    find_peer_binaries,
    fmt,
    list_prefix,
    log_events,
    machine_line,
    measure,
    median_of,
    peer_excludes,
    ratio,
    seconds_between,
    tail,
    use_local_s3_identity,
    vacuum,
    weed_master_port,
    workdir,
)

from ckptd.core import checksum
from ckptd.devtools.locals3 import LocalS3, free_port

TOOLS = ("ckptd", "aws", "s5cmd")
LABELS = {
    "ckptd": "ckptd",
    "ckptd-base": "ckptd, `--baseline` checkout",
    "ckptd-commit": "ckptd, complete → committed",
    "aws": "AWS CLI `s3 cp --recursive`",
    "s5cmd": "s5cmd `cp`",
    "s5cmd-sync": "s5cmd `cp` + `sync -f`",
}
CHECKPOINT = "step-500"


@dataclass(frozen=True)
class Shape:
    """A DCP-shaped checkpoint: ``count`` shards and a ``.metadata`` written last."""

    name: str
    files: tuple[tuple[str, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def many(count: int, size: int) -> Shape:
    files = [(f"__{i}_0.distcp", size) for i in range(count)]
    return Shape(f"{count}x{size // KIB}", (*files, (".metadata", size)))


def ranged(count: int, low: int, high: int, seed: int) -> Shape:
    rng = random.Random(seed)
    files = [(f"__{i}_0.distcp", rng.randint(low, high)) for i in range(count)]
    return Shape(f"{count}x{low // KIB}-{high // KIB}", (*files, (".metadata", low)))


def write_files(ckpt: Path, shape: Shape) -> None:
    """The shape's files of random bytes, in order (``.metadata`` last), then one sync."""
    ckpt.mkdir(parents=True, exist_ok=True)
    for rel, size in shape.files:
        fd = os.open(ckpt / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, os.urandom(size))
        finally:
            os.close(fd)
    os.sync()


def crcs_of(ckpt: Path, shape: Shape) -> dict[str, int]:
    return {rel: checksum.crc32c((ckpt / rel).read_bytes()) for rel, _ in shape.files}


# --- the commands --------------------------------------------------------------------------------


@dataclass
class Bench:
    work: Path
    server: LocalS3
    env: dict[str, str]
    bins: dict[str, str]
    pin: bool
    base_env: dict[str, str] | None = None  # --baseline: the other ckptd's PYTHONPATH

    def env_of(self, tool: str) -> dict[str, str]:
        return self.base_env if tool == "ckptd-base" and self.base_env else self.env

    @property
    def url(self) -> str:
        return self.server.endpoint_url

    def client(self, cmd: list[str]) -> list[str]:
        return ["taskset", "-c", "1", *cmd] if self.pin else cmd

    def ckptd(self, *args: str) -> list[str]:
        # -P: the ckptd imported is the one on PYTHONPATH (or installed), never a
        # checkout that happens to be the working directory.
        return [
            sys.executable,
            "-P",
            "-m",
            "ckptd",
            *args,
            "--config",
            str(self.work / "none.toml"),
        ]

    def upload(self, tool: str, watch: Path, prefix: str, url: str | None = None) -> list[str]:
        url = url or self.url
        ckpt = watch / CHECKPOINT
        if tool in ("ckptd", "ckptd-base"):
            state = self.work / "state" / prefix
            return self.ckptd(
                "run", "--once", "--watch", str(watch), "--dest", f"s3://{BUCKET}/{prefix}",
                "--endpoint-url", url, "--state-dir", str(state),
            )  # fmt: skip
        if tool == "aws":
            return [
                self.bins["aws"], "s3", "cp", "--recursive", "--no-progress", "--only-show-errors",
                str(ckpt), f"s3://{BUCKET}/{prefix}/{watch.name}/{CHECKPOINT}/", "--endpoint-url", url,
            ]  # fmt: skip
        if tool == "s5cmd":
            return [
                self.bins["s5cmd"], "--endpoint-url", url, "cp", f"{ckpt}/*",
                f"s3://{BUCKET}/{prefix}/{watch.name}/{CHECKPOINT}/",
            ]  # fmt: skip
        raise ValueError(tool)

    def restore(
        self, tool: str, run: str, prefix: str, out: Path, url: str | None = None
    ) -> list[str]:
        url = url or self.url
        src = f"s3://{BUCKET}/{prefix}/{run}/{CHECKPOINT}"
        dst = out / CHECKPOINT
        excludes = peer_excludes()
        if tool in ("ckptd", "ckptd-base"):
            return self.ckptd(
                "restore", "--dest", f"s3://{BUCKET}/{prefix}", "--endpoint-url", url,
                "--run", run, "--latest", "--to", str(out), "--no-progress",
            )  # fmt: skip
        if tool == "aws":
            return [
                self.bins["aws"], "s3", "cp", "--recursive", "--no-progress", "--only-show-errors",
                f"{src}/", str(dst), "--endpoint-url", url, *excludes,
            ]  # fmt: skip
        if tool in ("s5cmd", "s5cmd-sync"):
            cmd = [
                self.bins["s5cmd"],
                "--endpoint-url",
                url,
                "cp",
                *excludes,
                f"{src}/*",
                f"{dst}/",
            ]
            if tool == "s5cmd-sync":
                return ["sh", "-c", '"$@" && sync -f "$0"', str(dst), *cmd]
            return cmd
        raise ValueError(tool)


def check_listing(client: Any, prefix: str, run: str, shape: Shape) -> str | None:
    found = list_prefix(client, f"{prefix}/{run}/{CHECKPOINT}/")
    missing = [
        rel for rel, size in shape.files if found.get(f"{prefix}/{run}/{CHECKPOINT}/{rel}") != size
    ]
    if missing:
        return f"{len(missing)} file(s) missing or of another size, e.g. {missing[0]}"
    return None


def check_restored(shape: Shape, restored: Path, crcs: dict[str, int] | None) -> str | None:
    found = {p.name: p for p in restored.iterdir()} if restored.is_dir() else {}
    expected = {rel for rel, _ in shape.files}
    if set(found) != expected:
        return f"{len(expected - set(found))} missing, {len(set(found) - expected)} unexpected"
    for rel, size in shape.files:
        path = found[rel]
        if path.stat().st_size != size:
            return f"{rel}: {path.stat().st_size} bytes, expected {size}"
        if crcs is not None and checksum.crc32c(path.read_bytes()) != crcs[rel]:
            return f"{rel}: bytes differ"
    return None


# --- one measured run ----------------------------------------------------------------------------


@dataclass
class Result(ToolRun):
    direction: str = "up"
    commit_s: float | None = None  # ckptd upload: checkpoint_complete -> checkpoint_committed
    commit_cpu_s: float | None = None  # ckptd upload: cpu_seconds of checkpoint_committed


def timed(bench: Bench, cmd: list[str], label: str, tool: str = "") -> Any:
    return measure(
        bench.client(cmd),
        env=bench.env_of(tool),
        log_dir=bench.work / "logs",
        label=label,
        server_pid=bench.server.process.pid if bench.server.process else None,
        timeout=3600,
    )


def upload_once(bench: Bench, s3: Any, tool: str, shape: Shape, watch: Path, run: int) -> Result:
    prefix = f"up-{tool}-{shape.name}-{run}-{secrets.token_hex(3)}"
    m = timed(bench, bench.upload(tool, watch, prefix), prefix, tool)
    r = Result(tool, shape.name, run, shape.total_bytes, m, direction="up")
    r.error = f"exit {m.rc}: {tail(m.stderr, 5)}" if m.rc else None
    if r.error is None:
        r.error = check_listing(s3, prefix, watch.name, shape)
    if tool in ("ckptd", "ckptd-base") and m.stderr is not None:
        events = log_events(m.stderr)
        r.commit_s = seconds_between(events, "checkpoint_complete", "checkpoint_committed")
        done = [e for e in events if e.get("event") == "checkpoint_committed"]
        r.commit_cpu_s = float(done[-1]["cpu_seconds"]) if done else None
    delete_prefix(s3, prefix + "/")
    return r


def restore_once(
    bench: Bench, tool: str, shape: Shape, run_id: str, prefix: str, run: int, crcs: dict[str, int]
) -> Result:
    out = bench.work / "out" / f"{tool}-{shape.name}-{run}"
    m = timed(bench, bench.restore(tool, run_id, prefix, out), out.name, tool)
    r = Result(tool, shape.name, run, shape.total_bytes, m, direction="down")
    r.error = f"exit {m.rc}: {tail(m.stderr, 5)}" if m.rc else None
    if r.error is None:
        r.error = check_restored(shape, out / CHECKPOINT, crcs if run == 1 else None)
    # Kept until the shape's runs are over: on ext4 without a journal, a file created
    # within a minute of thousands deleted makes the inode allocator step over each of
    # them (``recently_deleted``), a cost of the bench's loop that no restore on a
    # fresh node pays, and that fell on whichever tool ran next.
    return r


def settle(bench: Bench) -> None:
    """Reclaim deleted objects and flush the disk between runs (untimed)."""
    pid = bench.server.process.pid if bench.server.process else None
    port = weed_master_port(pid) if pid else None
    if port is not None:
        vacuum(port)
    os.sync()


# --- requests per file ---------------------------------------------------------------------------


def requests_per_file(
    bench: Bench, s3: Any, tools: Sequence[str], shape: Shape, watch: Path
) -> dict[str, dict[str, Any]]:
    """Each tool's requests, up and down, through the fault proxy (which counts them)."""
    from tests.support.faultproxy import FaultProxy

    files = len(shape.files)
    keys = {rel for rel, _ in shape.files}
    found: dict[str, dict[str, Any]] = {}
    with FaultProxy(bench.url) as proxy:
        for tool in tools:
            prefix = f"req-{tool}-{shape.name}-{secrets.token_hex(3)}"
            proxy.reset_counters()
            done = subprocess.run(
                bench.upload(tool, watch, prefix, proxy.url), env=bench.env, capture_output=True
            )
            up = _count(proxy.requests, keys)
            proxy.reset_counters()
            out = bench.work / "out" / f"req-{tool}"
            back = subprocess.run(
                bench.restore(tool, watch.name, prefix, out, proxy.url),
                env=bench.env,
                capture_output=True,
            )
            down = _count(proxy.requests, keys)
            shutil.rmtree(out, ignore_errors=True)
            delete_prefix(s3, prefix + "/")
            found[tool] = {
                "ok": done.returncode == 0 and back.returncode == 0,
                "up_per_file": up["total"] / files,
                "up_on_files": up["on_files"] / files,
                "up_other": up["other"],
                "down_per_file": down["total"] / files,
                "down_on_files": down["on_files"] / files,
                "down_other": down["other"],
                "up_kinds": up["kinds"],
                "down_kinds": down["kinds"],
            }
    return found


def _count(requests: Sequence[Any], keys: set[str]) -> dict[str, Any]:
    on_files = sum(1 for r in requests if r.path.rsplit("/", 1)[-1] in keys)
    kinds = collections.Counter(f"{r.method} {_kind(r.path, r.query, keys)}" for r in requests)
    return {
        "total": len(requests),
        "on_files": on_files,
        "other": len(requests) - on_files,
        "kinds": dict(kinds.most_common()),
    }


def _kind(path: str, query: str, keys: set[str]) -> str:
    name = path.rsplit("/", 1)[-1]
    if name in keys:
        return "<file>"
    if query:
        return "?" + re.sub(r"=.*", "", query.split("&")[0])
    return name or "/"


# --- 100,000 files -------------------------------------------------------------------------------


def daemon_config(bench: Bench, watch: Path, prefix: str, port: int, keep_last: int) -> Path:
    config = bench.work / f"daemon-{prefix}.toml"
    config.write_text(
        "\n".join(
            [
                "[[watch]]",
                f"dir = {json.dumps(str(watch))}",
                "[destination]",
                f'url = "s3://{BUCKET}/{prefix}"',
                f"endpoint_url = {json.dumps(bench.url)}",
                "[retention]",
                f"keep_last = {keep_last}",
                "[preemption]",
                'provider = "none"',
                "[metrics]",
                f'listen = "127.0.0.1:{port}"',
                "[state]",
                f"dir = {json.dumps(str(bench.work / 'state' / prefix))}",
            ]
        )
        + "\n"
    )
    return config


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def save_while_watched(
    bench: Bench, daemon: subprocess.Popen[bytes], log: Path, ckpt: Path, shape: Shape
) -> dict[str, Any]:
    """Write ``shape`` into the watched dir as a trainer does; wait for its commit."""
    from common import proc_cpu_seconds

    cpu0 = proc_cpu_seconds(daemon.pid)
    started = time.time()
    write_files(ckpt, shape)
    written = time.time()
    deadline = written + 3600
    committed = None
    while committed is None and time.time() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited: {tail(log, 20)}")
        for e in log_events(log):
            if e.get("event") == "checkpoint_committed" and e.get("checkpoint") == ckpt.name:
                committed = e
        time.sleep(0.5)
    if committed is None:
        raise SystemExit(f"{ckpt.name} not committed within an hour: {tail(log, 20)}")
    events = log_events(log)
    from common import event_time

    done_at = event_time(committed)
    early = [
        e
        for e in events
        if e.get("event") == "early_batch_done" and e.get("checkpoint") == ckpt.name
    ]
    return {
        "write_s": written - started,
        "last_write_to_committed_s": done_at - written,
        "start_to_committed_s": done_at - started,
        "complete_to_committed_s": seconds_between(
            [e for e in events if e.get("checkpoint") == ckpt.name],
            "checkpoint_complete",
            "checkpoint_committed",
        ),
        "sent_early_files": sum(int(e.get("files", 0)) for e in early),
        "daemon_cpu_s": proc_cpu_seconds(daemon.pid) - cpu0,
        "daemon_peak_rss_mib": vm_hwm_mib(daemon.pid),
    }


def scale_part(bench: Bench, s3: Any, count: int) -> dict[str, Any]:
    """The 100,000-file part (module doc)."""
    from ckptd.core.manifest import build_manifest, parse_manifest

    shape = ranged(count, 4 * KIB, 64 * KIB, seed=38)
    watch = bench.work / "data" / f"scale{count}"
    watch.mkdir(parents=True, exist_ok=True)
    prefix = f"scale-{secrets.token_hex(3)}"
    port = free_port()
    log = bench.work / "logs" / f"{prefix}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    config = daemon_config(bench, watch, prefix, port, keep_last=1)
    out: dict[str, Any] = {"files": count, "bytes": shape.total_bytes}
    with open(log, "ab") as sink:
        daemon = subprocess.Popen(
            bench.client([sys.executable, "-P", "-m", "ckptd", "run", "--config", str(config)]),
            env=bench.env,
            stdout=sink,
            stderr=sink,
        )
    try:
        first = watch / CHECKPOINT
        out["first"] = save_while_watched(bench, daemon, log, first, shape)
        crcs = crcs_of(first, shape)
        key = f"{prefix}/{watch.name}/{CHECKPOINT}/ckptd.manifest.json"
        body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        out["manifest_bytes"] = len(body)
        t0 = time.perf_counter()
        manifest = parse_manifest(body)
        out["manifest_read_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = build_manifest(
            run_id=manifest.run_id,
            checkpoint=manifest.checkpoint,
            step=manifest.step,
            layout=manifest.layout,
            host=manifest.host,
            created_at=0,
            committed_at=0,
            files=[(f.path, f.size, f.crc32c) for f in manifest.files],
            environment=manifest.environment,
        ).to_bytes()
        out["manifest_write_s"] = time.perf_counter() - t0
        assert abs(len(again) - len(body)) < 200, "the manifest rebuilt is not the one written"
        for name, cmd in (
            ("list", bench.ckptd("list", "--dest", f"s3://{BUCKET}/{prefix}", "--endpoint-url", bench.url)),
            ("verify", bench.ckptd("verify", "--dest", f"s3://{BUCKET}/{prefix}", "--endpoint-url", bench.url, "--run", watch.name, "--latest")),
        ):  # fmt: skip
            m = timed(bench, cmd, f"{prefix}-{name}")
            out[name] = {"ok": m.rc == 0, "wall_s": m.wall_s, "cpu_s": m.cpu_s}
        restored = bench.work / "out" / prefix
        m = timed(bench, bench.restore("ckptd", watch.name, prefix, restored), f"{prefix}-restore")
        problem = (
            check_restored(shape, restored / CHECKPOINT, crcs) if m.rc == 0 else tail(m.stderr)
        )
        out["restore"] = {
            "ok": problem is None,
            "error": problem,
            "wall_s": m.wall_s,
            "cpu_s": m.cpu_s,
            "peak_rss_mib": m.maxrss_kib / 1024,
        }
        shutil.rmtree(restored, ignore_errors=True)
        # A second checkpoint: keep_last = 1 makes its commit delete the first.
        second = watch / "step-600"
        out["second"] = save_while_watched(bench, daemon, log, second, shape)
        left = list_prefix(s3, f"{prefix}/{watch.name}/{CHECKPOINT}/")
        out["first_deleted_by_retention"] = not left
        out["first_objects_left"] = len(left)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        delete_prefix(s3, prefix + "/")
        shutil.rmtree(watch, ignore_errors=True)
    return out


# --- reporting -----------------------------------------------------------------------------------


def row(results: Sequence[Result], tool: str) -> dict[str, float | None]:
    good = [r for r in results if r.tool == tool and r.error is None]
    return {
        "wall": median_of([r.m.wall_s for r in good]),
        "cpu": median_of([r.m.cpu_s for r in good]),
        "rss": median_of([r.m.maxrss_kib / 1024 for r in good]),
        "server": median_of([r.m.server_cpu_s for r in good]),
        "other": median_of([r.m.other_cpu_s for r in good]),
        "commit": median_of([r.commit_s for r in good]),
        "commit_cpu": median_of([r.commit_cpu_s for r in good]),
        "ok": float(len(good)),
        "runs": float(len([r for r in results if r.tool == tool])),
    }


def render_shape(
    shape: Shape, results: list[Result], tools: Sequence[str], requests: dict[str, Any]
) -> list[str]:
    lines = [
        f"### {shape.name}: {len(shape.files):,} files, {shape.total_bytes / MIB:.1f} MiB",
        "",
        "| direction | tool | wall s | client CPU s | peak RSS MiB | server CPU s | other CPU s "
        "| requests / file | wall ÷ s5cmd's | CPU ÷ s5cmd's | ok |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for direction in ("up", "down"):
        mine = [r for r in results if r.shape == shape.name and r.direction == direction]
        names = [*tools, *(["s5cmd-sync"] if direction == "down" and "s5cmd" in tools else [])]
        rows = {t: row(mine, t) for t in names}
        peer = rows.get("s5cmd")
        if direction == "up" and "ckptd" in rows:
            # What a running daemon pays per checkpoint: complete -> committed.
            rows["ckptd-commit"] = {
                **rows["ckptd"],
                "wall": rows["ckptd"]["commit"],
                "cpu": rows["ckptd"]["commit_cpu"],
                "rss": None,
                "server": None,
                "other": None,
            }
        for tool, r in rows.items():
            base = tool.replace("-commit", "").replace("-sync", "")
            req = requests.get(base, {}).get(f"{direction}_per_file")
            lines.append(
                f"| {direction} | {LABELS[tool]} | {fmt(r['wall'])} | {fmt(r['cpu'])} "
                f"| {fmt(r['rss'], '.0f')} | {fmt(r['server'])} | {fmt(r['other'])} "
                f"| {fmt(req, '.3f')} "
                f"| {fmt(ratio(r['wall'], peer['wall']) if peer else None)} "
                f"| {fmt(ratio(r['cpu'], peer['cpu']) if peer else None)} "
                f"| {int(r['ok'] or 0)}/{int(r['runs'] or 0)} |"
            )
    for tool, found in requests.items():
        lines.append("")
        lines.append(
            f"- {LABELS[tool]} requests: up {found['up_on_files']:.3f} per file on the files "
            f"+ {found['up_other']} others ({_kinds(found['up_kinds'])}); down "
            f"{found['down_on_files']:.3f} per file + {found['down_other']} others "
            f"({_kinds(found['down_kinds'])})."
        )
    for r in results:
        if r.shape == shape.name and r.error:
            lines.append(f"- {LABELS[r.tool]} {r.direction} run {r.run} failed: {r.error}")
    lines.append("")
    return lines


def _kinds(kinds: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in kinds.items() if "<file>" not in k)


def render_scale(found: dict[str, Any]) -> list[str]:
    first, second = found["first"], found["second"]
    return [
        f"### {found['files']:,} files of 4-64 KiB, {found['bytes'] / MIB:,.0f} MiB, one checkpoint",
        "",
        "| what | figure |",
        "|---|---:|",
        f"| written by the bench (fsynced once at the end) | {fmt(first['write_s'], '.1f')} s |",
        f"| last file written → committed (daemon, `ship_early` on) | {fmt(first['last_write_to_committed_s'], '.1f')} s |",
        f"| files sent before the checkpoint was complete | {first['sent_early_files']:,} |",
        f"| daemon CPU over the save and ship | {fmt(first['daemon_cpu_s'], '.1f')} s |",
        f"| daemon peak RSS (VmHWM) | {fmt(first['daemon_peak_rss_mib'], '.0f')} MiB |",
        f"| manifest size | {found['manifest_bytes'] / MIB:.1f} MiB ({found['manifest_bytes'] / found['files']:.0f} bytes per file) |",
        f"| manifest build + serialise (write) | {fmt(found['manifest_write_s'], '.2f')} s |",
        f"| manifest parse + validate (read) | {fmt(found['manifest_read_s'], '.2f')} s |",
        f"| `ckptd list` | {fmt(found['list']['wall_s'])} s |",
        f"| `ckptd verify --latest` | {fmt(found['verify']['wall_s'])} s |",
        f"| `ckptd restore --latest` (every byte checked against the files written) | {fmt(found['restore']['wall_s'], '.1f')} s, {fmt(found['restore']['cpu_s'], '.1f')} CPU-s, peak RSS {fmt(found['restore']['peak_rss_mib'], '.0f')} MiB, {'identical' if found['restore']['ok'] else found['restore']['error']} |",
        f"| second checkpoint, last file → committed (`keep_last = 1`) | {fmt(second['last_write_to_committed_s'], '.1f')} s |",
        f"| the first deleted by retention | {'yes, every object' if found['first_deleted_by_retention'] else str(found['first_objects_left']) + ' objects left'} |",
        f"| daemon peak RSS after both | {fmt(second['daemon_peak_rss_mib'], '.0f')} MiB |",
        "",
    ]  # fmt: skip


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="rounds (medians)")
    parser.add_argument("--shapes", default="3000x64,30000x4", help="COUNTxKIB,...")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument(
        "--scale", type=int, default=100_000, help="files of the scale part; 0 = skip"
    )
    parser.add_argument("--pin", action="store_true", help="server on CPU 0, clients on CPU 1")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another ckptd checkout measured side by side as tool ckptd-base (before/after)",
    )
    parser.add_argument(
        "--cold-bytecode",
        action="store_true",
        help="do not byte-compile the ckptd measured first (module doc)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a run of seconds that every part still does: 1 run, 50 x 4 KiB, 200 files at "
        "scale, ckptd alone unless --tools names peers (tests/e2e/test_bench_manyfiles.py)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        given = argv if argv is not None else sys.argv[1:]
        args.runs, args.shapes, args.scale = 1, "50x4", 200
        if not any(a.startswith("--tools") for a in given):
            args.tools = "ckptd"

    tools = [t for t in args.tools.split(",") if t]
    if args.baseline is not None and "ckptd-base" not in tools:
        tools.insert(1 if "ckptd" in tools else 0, "ckptd-base")
    bins = find_peer_binaries(tools)
    for tool in [t for t in tools if not t.startswith("ckptd") and t not in bins]:
        print(
            f"warning: {tool} not found, skipped (bench/README.md says how to install it)",
            file=sys.stderr,
        )
        tools.remove(tool)
    shapes = []
    for spec in [s for s in args.shapes.split(",") if s]:
        count, kib = spec.split("x")
        shapes.append(many(int(count), int(kib) * KIB))
    machine = machine_line()
    use_local_s3_identity()
    results: list[Result] = []
    requests: dict[str, dict[str, Any]] = {}
    scale: dict[str, Any] | None = None
    with workdir(args.workdir, args.keep, "ckptd-bench-manyfiles-") as work:
        (work / "none.toml").write_text("")  # never a machine's /etc/ckptd/ckptd.toml
        server = LocalS3(work / "seaweedfs", buckets=(BUCKET,)).start()
        try:
            if args.pin and server.process is not None:
                subprocess.run(
                    ["taskset", "-a", "-p", "-c", "0", str(server.process.pid)],
                    check=True,
                    capture_output=True,
                )
            env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
            env.update(server.env())
            if "ckptd" in tools and not args.cold_bytecode:
                compile_ckptd(env)
            base_env = None
            if args.baseline is not None:
                base_env = dict(env, PYTHONPATH=str(args.baseline.resolve()))
                if not args.cold_bytecode:
                    compile_ckptd(base_env)
            bench = Bench(work, server, env, bins, args.pin, base_env)
            import boto3

            s3 = boto3.client("s3", endpoint_url=server.endpoint_url)
            versions = {"python": sys.version.split()[0]}
            if "aws" in bins:
                versions["aws-cli"] = command_version([bins["aws"], "--version"], r"aws-cli/\S+")
            if "s5cmd" in bins:
                versions["s5cmd"] = command_version([bins["s5cmd"], "version"], r"v\d\S*")
            for shape in shapes:
                watch = work / "data" / shape.name
                write_files(watch / CHECKPOINT, shape)
                crcs = crcs_of(watch / CHECKPOINT, shape)
                source = f"src-{shape.name}"
                subprocess.run(
                    bench.upload("ckptd", watch, source), env=env, check=True, capture_output=True
                )
                for run in range(1, args.runs + 1):
                    order = tools[run % len(tools) :] + tools[: run % len(tools)]
                    for tool in order:
                        settle(bench)
                        r = upload_once(bench, s3, tool, shape, watch, run)
                        results.append(r)
                        _say(r)
                    for tool in [*order, *(["s5cmd-sync"] if "s5cmd" in order else [])]:
                        settle(bench)
                        r = restore_once(bench, tool, shape, watch.name, source, run, crcs)
                        results.append(r)
                        _say(r)
                counted = [t for t in tools if t != "ckptd-base"]
                requests[shape.name] = requests_per_file(bench, s3, counted, shape, watch)
                shutil.rmtree(work / "out", ignore_errors=True)
                delete_prefix(s3, source + "/")
                shutil.rmtree(watch, ignore_errors=True)
            if args.scale:
                settle(bench)
                scale = scale_part(bench, s3, args.scale)
                print(json.dumps(scale, indent=1), file=sys.stderr)
        finally:
            server.stop()

    lines = [
        "## Many small files, up and down, against loopback SeaweedFS",
        "",
        f"Machine: {machine}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        f"Median of {args.runs} run(s), tools in a rotating order, each at its defaults (ckptd: "
        + ("byte-compiled as installed, " if not args.cold_bytecode else "not byte-compiled, ")
        + "concurrency 8). Client CPU = user+sys of the tool's process tree (ckptd complete → "
        "committed: the daemon's CPU over that span, from its log); server CPU = `weed`'s. "
        + ("SeaweedFS pinned to CPU 0, the clients to CPU 1." if args.pin else "Server and clients share both cores.")
        + " Restores: ckptd checks the CRC-32C of every byte and makes every file durable "
        "before its atomic rename (one `syncfs` where the filesystem allows, else an fsync of "
        "each); the peers do neither (the `+ sync -f` row makes s5cmd's durable). "
        f"Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "",
    ]  # fmt: skip
    for shape in shapes:
        lines += render_shape(shape, results, tools, requests.get(shape.name, {}))
    if scale is not None:
        lines += render_scale(scale)
    print("\n".join(lines))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "versions": versions,
                    "runs": args.runs,
                    "pinned": args.pin,
                    "results": [r.as_dict() for r in results],
                    "requests": requests,
                    "scale": scale,
                    "table": lines,
                },
                indent=2,
            )
            + "\n"
        )
    failed = any(r.error for r in results) or (
        scale is not None and not (scale["restore"]["ok"] and scale["first_deleted_by_retention"])
    )
    return 1 if failed else 0


def compile_ckptd(env: dict[str, str]) -> None:
    """Byte-compile the ckptd that ``env``'s runs import (module doc)."""
    subprocess.run(
        [
            sys.executable,
            "-P",
            "-c",
            "import compileall, ckptd, sys; "
            "sys.exit(not compileall.compile_dir(ckptd.__path__[0], quiet=1))",
        ],
        env=env,
        check=True,
        capture_output=True,
    )


def _say(r: Result) -> None:
    print(
        f"{r.shape} {r.direction:<4} run {r.run} {r.tool:<10} {r.m.wall_s:7.2f}s cpu {r.m.cpu_s:6.2f}s "
        f"{'' if r.commit_s is None else f'(commit {r.commit_s:.2f}s cpu {r.commit_cpu_s:.2f}s) '}"
        f"load {os.getloadavg()[0]:.2f} {'ok' if r.error is None else r.error}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    raise SystemExit(main())
