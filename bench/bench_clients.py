"""boto3's two transfer clients, classic s3transfer and CRT, on the same bytes, up and down.

    .venv/bin/python bench/bench_clients.py [--scale 1.0] [--runs 3] [--size-mib 1536]
        [--files 256] [--part-size-mib-up 64] [--part-size-mib-down 16] [--concurrency 8]
        [--crt-target-gbps G] [--json FILE] [--workdir DIR] [--keep]

One loopback SeaweedFS (``ckptd.devtools.locals3``); two shapes of random bytes (fsynced, in the
page cache): ``single``, one file of ``--size-mib``, and ``dcp``, ``--files`` shards of
4 MiB plus a ``.metadata`` (``--scale`` multiplies the size and the shard count). Each
round uploads each shape with each client into a fresh prefix (listed, then deleted),
and downloads a copy seeded before timing into a fresh directory (file count and sizes
checked, then deleted); the order of the clients alternates between rounds; the store
is vacuumed and the disk synced between rounds, untimed.

Every transfer is a fresh ``_client_transfer.py`` process under ``_measure.py``: wall,
user+sys CPU of the process and its peak RSS; the server's CPU is read from /proc around
it. The child also reports its own start-up (imports, client creation) and transfer
(listing included) split, so the table shows transfer-only CPU as well as whole-process.
For uploads, the largest object's part count and first-part size (from the store) show
the part size each client really used.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import secrets
import shutil
import statistics
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
    Measurement,
    Shape,
    command_version,
    dcp_shape,
    delete_prefix,
    fmt,
    list_prefix,
    machine_line,
    measure,
    ratio,
    tail,
    vacuum,
    weed_master_port,
    workdir,
    write_shape,
)

from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY, LocalS3

CLIENTS = ("classic", "crt")
CHILD = BENCH_DIR / "_client_transfer.py"


@dataclass
class Run:
    shape: str
    direction: str
    client: str
    run: int
    bytes: int
    m: Measurement
    child: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    parts: tuple[int, int] | None = None  # uploads: (part count, first part bytes)


@dataclass
class Ctx:
    work: Path
    server: LocalS3
    env: dict[str, str]
    s3: Any
    args: argparse.Namespace

    @property
    def server_pid(self) -> int | None:
        return self.server.process.pid if self.server.process else None

    def cmd(self, client: str, direction: str, prefix: str, local: Path) -> list[str]:
        part = self.args.part_size_mib_up if direction == "up" else self.args.part_size_mib_down
        return [
            sys.executable,
            str(CHILD),
            *("--client", client, "--direction", direction),
            *("--endpoint-url", self.server.endpoint_url, "--bucket", BUCKET),
            *("--prefix", prefix, "--part-size-mib", str(part)),
            *("--concurrency", str(self.args.concurrency)),
            *(["--crt-target-gbps", str(g)] if (g := self.args.crt_target_gbps) else []),
            str(local),
        ]


def check_files(found: dict[str, int], shape: Shape) -> str | None:
    """None if ``found`` (relative path -> size) is exactly the shape's files."""
    want = dict(shape.files)
    bad = [f"{k}: {found.get(k)} bytes, expected {v}" for k, v in want.items() if found.get(k) != v]
    bad += [f"unexpected {k}" for k in found.keys() - want.keys()]
    return "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "") or None


def object_parts(s3: Any, key: str) -> tuple[int, int]:
    """(part count, size of part 1) of a stored object; (1, size) if not multipart."""
    etag = str(s3.head_object(Bucket=BUCKET, Key=key)["ETag"]).strip('"')
    if "-" not in etag:
        return 1, int(s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"])
    first = s3.head_object(Bucket=BUCKET, Key=key, PartNumber=1)["ContentLength"]
    return int(etag.rsplit("-", 1)[1]), int(first)


def run_one(ctx: Ctx, shape: Shape, ckpt: Path, direction: str, client: str, run: int) -> Run:
    unique = f"{client}-{shape.name}-{direction}-r{run}-{secrets.token_hex(3)}"
    if direction == "up":
        prefix, local = unique, ckpt
    else:
        prefix, local = f"seed/{shape.name}", ctx.work / "down" / unique
    m = measure(
        ctx.cmd(client, direction, prefix, local),
        env=ctx.env,
        log_dir=ctx.work / "logs",
        label=unique,
        server_pid=ctx.server_pid,
    )
    r = Run(shape.name, direction, client, run, shape.total_bytes, m)
    if m.rc != 0 or m.stdout is None:
        r.error = f"exit {m.rc}: {tail(m.stderr, 5)}"
    else:
        r.child = json.loads(m.stdout.read_text().strip().splitlines()[-1])
    if direction == "up":
        found = {k[len(prefix) + 1 :]: v for k, v in list_prefix(ctx.s3, prefix + "/").items()}
        r.error = r.error or check_files(found, shape)
        if r.error is None:
            big = max(shape.files, key=lambda f: f[1])[0]
            r.parts = object_parts(ctx.s3, f"{prefix}/{big}")
        delete_prefix(ctx.s3, prefix + "/")
    else:
        files = [p for p in local.rglob("*") if p.is_file()] if local.exists() else []
        found = {p.relative_to(local).as_posix(): p.stat().st_size for p in files}
        r.error = r.error or check_files(found, shape)
        shutil.rmtree(local, ignore_errors=True)
    os.sync()  # this run's writes go to disk now, not in the next run's time
    return r


def settle(ctx: Ctx) -> None:
    port = weed_master_port(ctx.server_pid) if ctx.server_pid else None
    if port is not None:
        vacuum(port)
    os.sync()


def med(runs: Sequence[Run], get: Callable[[Run], float]) -> float | None:
    values = [get(r) for r in runs]
    return statistics.median(values) if values else None


def table(shape: Shape, direction: str, runs: list[Run]) -> list[str]:
    gib, mib = shape.total_bytes / GIB, shape.total_bytes / MIB
    lines = [
        f"### {shape.name} {direction}: {len(shape.files)} file(s), {mib:.1f} MiB",
        "",
        "| client | wall s | MiB/s | process CPU s/GiB | transfer-only CPU s/GiB "
        "| MiB per CPU-s (transfer-only) | transfer-only MiB/s | start-up CPU s | peak RSS MiB "
        "| server CPU s/GiB | ok runs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    per_cpu: dict[str, float | None] = {}
    rss: dict[str, float | None] = {}
    notes: list[str] = []
    for client in CLIENTS:
        mine = [r for r in runs if r.client == client]
        good = [r for r in mine if r.error is None]
        wall = med(good, lambda r: r.m.wall_s)
        xfer_s = med(good, lambda r: r.child["transfer_s"])
        xfer_cpu = med(good, lambda r: r.child["transfer_cpu_s"])
        per_cpu[client] = mib / xfer_cpu if xfer_cpu else None
        rss[client] = med(good, lambda r: r.m.maxrss_kib / 1024)
        lines.append(
            f"| {client} | {fmt(wall)} | {fmt(ratio(mib, wall), '.0f')} "
            f"| {fmt(med(good, lambda r: r.m.cpu_s / gib))} "
            f"| {fmt(ratio(xfer_cpu, gib))} | {fmt(per_cpu[client], '.0f')} "
            f"| {fmt(ratio(mib, xfer_s), '.0f')} "
            f"| {fmt(med(good, lambda r: r.child['startup_cpu_s']))} "
            f"| {fmt(rss[client], '.0f')} "
            f"| {fmt(med(good, lambda r: r.m.server_cpu_s / gib))} | {len(good)}/{len(mine)} |"
        )
        parts = sorted({r.parts for r in good if r.parts})
        threads = sorted({int(r.child["threads"]) for r in good})
        if parts:
            used = ", ".join(f"{n} x {size / MIB:.1f} MiB" for n, size in parts)
            notes.append(f"- {client}: largest object stored as {used} parts")
        other = fmt(med(good, lambda r: r.m.other_cpu_s), ".1f")
        notes.append(
            f"- {client}: threads at the end of the transfer {threads}; other CPU {other} s"
        )
        notes += [f"- {client} run {r.run} failed: {r.error}" for r in mine if r.error]
    a, b = per_cpu["classic"], per_cpu["crt"]
    if a and b:
        win, lose = ("classic", "crt") if a >= b else ("crt", "classic")
        lines += [
            "",
            f"**{shape.name} {direction}: {win} wins on throughput per CPU second**, "
            f"{per_cpu[win]:.0f} vs {per_cpu[lose]:.0f} MiB per transfer-only CPU-second "
            f"({ratio(per_cpu[win], per_cpu[lose]):.2f}x).",
        ]
    if direction == "up":
        lines.append(
            "Peak RSS while uploading (target < 150 MiB): "
            + ", ".join(
                f"{c} {fmt(rss[c], '.0f')} MiB ({'met' if (rss[c] or 1e9) < 150 else 'missed'})"
                for c in CLIENTS
            )
            + "."
        )
    return [*lines, "", *notes, ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="multiply sizes and shard count")
    p.add_argument("--runs", type=int, default=3, help="rounds (median)")
    p.add_argument("--size-mib", type=int, default=1536, help="the single file's size")
    p.add_argument("--files", type=int, default=256, help="4 MiB shards of the dcp shape")
    p.add_argument("--part-size-mib-up", type=int, default=64)
    p.add_argument("--part-size-mib-down", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="classic client only")
    p.add_argument("--crt-target-gbps", type=float, default=None, help="crt: throughput target")
    p.add_argument("--json", type=Path, default=None, help="also write all runs here")
    p.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    p.add_argument("--keep", action="store_true", help="keep the work dir (data, logs)")
    args = p.parse_args(argv)

    import awscrt.s3
    import boto3

    machine = machine_line()
    target = args.crt_target_gbps or awscrt.s3.get_recommended_throughput_target_gbps()
    versions = {
        "python": sys.version.split()[0],
        "boto3": importlib.metadata.version("boto3"),
        "botocore": importlib.metadata.version("botocore"),
        "s3transfer": importlib.metadata.version("s3transfer"),
        "awscrt": importlib.metadata.version("awscrt"),
        "seaweedfs": command_version(
            [str(Path(sys.executable).parent / "weed"), "version"], r"(?<=version )\S+ \S+"
        ),
    }
    single = Shape(
        "single", "ckpt", (("model.safetensors", int(args.size_mib * MIB * args.scale)),)
    )
    shapes = [single, dcp_shape(args.scale * args.files / 256)]
    runs: list[Run] = []
    with workdir(args.workdir, args.keep) as work, LocalS3(work / "seaweedfs") as server:
        print(f"work dir: {work}", file=sys.stderr)
        ckpts = [write_shape(work / "data", s)[1] for s in shapes]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
        env.update(server.env())
        env["AWS_CONFIG_FILE"] = str(work / "aws-config-none")
        env["AWS_SHARED_CREDENTIALS_FILE"] = str(work / "aws-credentials-none")
        s3 = boto3.client(
            "s3",
            server.env()["AWS_DEFAULT_REGION"],
            endpoint_url=server.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )
        ctx = Ctx(work, server, env, s3, args)
        for shape, ckpt in zip(shapes, ckpts, strict=True):  # the downloads' source, untimed
            seed = ctx.cmd("classic", "up", f"seed/{shape.name}", ckpt)
            subprocess.run(seed, env=env, check=True, capture_output=True)
        settle(ctx)
        for run in range(1, args.runs + 1):
            order = CLIENTS if run % 2 else CLIENTS[::-1]
            for shape, ckpt in zip(shapes, ckpts, strict=True):
                for direction in ("up", "down"):
                    for client in order:
                        r = run_one(ctx, shape, ckpt, direction, client, run)
                        runs.append(r)
                        print(
                            f"run {run} {shape.name:<6} {direction:<4} {client:<7} "
                            f"{r.m.wall_s:6.2f}s cpu {r.m.cpu_s:6.2f}s "
                            f"rss {r.m.maxrss_kib / 1024:5.0f}MiB {r.error or 'ok'}",
                            file=sys.stderr,
                        )
                settle(ctx)
    lines = [
        "## boto3 transfer clients: classic s3transfer vs CRT, loopback SeaweedFS",
        "",
        f"Machine: {machine}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        f"Scale {args.scale}, median of {args.runs} round(s), clients' order alternating. "
        f"Part size {args.part_size_mib_up} MiB up, {args.part_size_mib_down} MiB down; "
        f"classic: concurrency {args.concurrency}, BOTO_DISABLE_CRT=true (botocore's signer); "
        f"crt: default threads, throughput target {target or '10 (its fallback)'} Gb/s. "
        "Wall, MiB/s, process CPU and peak RSS are the whole process (interpreter start "
        "included); transfer-only is the child's own split after imports and client "
        "creation. Server CPU = `weed` (same machine, same CPUs); other CPU = the rest of "
        "the machine's busy time during the run (other load, kernel threads).",
        "",
    ]
    for shape in shapes:
        for direction in ("up", "down"):
            mine = [r for r in runs if r.shape == shape.name and r.direction == direction]
            lines += table(shape, direction, mine)
    print("\n".join(lines))
    if args.json is not None:
        doc: dict[str, Any] = {
            "machine": machine,
            "versions": versions,
            "args": vars(args) | {"json": None},
            "runs": [asdict(r) for r in runs],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc | {"table": lines}, indent=2, default=str) + "\n")
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    start = time.monotonic()
    rc = main()
    print(f"done in {time.monotonic() - start:.0f}s", file=sys.stderr)
    raise SystemExit(rc)
