"""A ``file://`` destination on the same disk (the shared-NVMe case): ckptd against
``rsync -a`` + ``sync`` and ``cp -r`` + ``sync``, with ``dd`` as the disk's limit.

    .venv/bin/python bench/bench_filedest.py                  # 1.5 GiB hf checkpoint, 3 runs
    .venv/bin/python bench/bench_filedest.py --scale 0.5 --runs 1

The checkpoint is written once (random bytes, fsynced, left in the page cache as a
trainer leaves it); every tool copies it into a fresh directory on the same filesystem,
interleaved, ``--runs`` times. Durability is part of the job: rsync and cp are followed by
``sync -f`` on the destination (without it they stop at the page cache); ckptd fsyncs
every file and directory itself, checksums every byte (CRC-32C), and writes its manifest.

Rows: ckptd as a process (``ckptd run --once``: start-up, scan, copy, commit) and from
its ``checkpoint_complete`` to its ``checkpoint_committed`` log event (what a running
daemon takes per checkpoint); ``rsync -a`` + ``sync -f``; ``cp -r`` + ``sync -f``;
``dd`` (``conv=fsync``, 64 MiB blocks) of the same files, the plain write of these bytes.
Between runs the destination is removed and the filesystem synced, untimed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common

from common import (
    GIB,
    ckptd_command,
    fmt,
    hf_shape,
    log_events,
    machine_line,
    measure,
    median_of,
    seconds_between,
    snapshot_ckptd,
    workdir,
    write_shape,
)

TOOLS = ("ckptd", "rsync", "cp", "dd")


def command(tool: str, work: Path, watch: Path, ckpt: Path, dest: Path, src: Path) -> list[str]:
    if tool == "ckptd":
        config = work / "ckptd.toml"
        config.write_text('[preemption]\nprovider = "none"\n')
        return [
            *ckptd_command(src),
            "run",
            "--once",
            "--watch",
            str(watch),
            "--dest",
            f"file://{dest}",
            "--state-dir",
            str(work / "state" / dest.name),
            "--config",
            str(config),
        ]
    if tool == "rsync":
        return ["sh", "-c", f'mkdir -p "{dest}" && rsync -a "{ckpt}" "{dest}/" && sync -f "{dest}"']
    if tool == "cp":
        return ["sh", "-c", f'mkdir -p "{dest}" && cp -r "{ckpt}" "{dest}/" && sync -f "{dest}"']
    if tool == "dd":
        copies = " && ".join(
            f'dd if="{p}" of="{dest}/{p.name}" bs=64M conv=fsync status=none'
            for p in sorted(ckpt.iterdir())
        )
        return ["sh", "-c", f'mkdir -p "{dest}" && {copies}']
    raise ValueError(tool)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    with workdir(args.workdir, args.keep, prefix="ckptd-filedest-") as work:
        src, digest = snapshot_ckptd(work / "ckptd-src")
        shape = hf_shape(args.scale)
        watch, ckpt = write_shape(work, shape)
        header = (
            f"bench_filedest: {shape.total_bytes / GIB:.2f} GiB hf checkpoint, same filesystem, "
            f"{args.runs} runs; ckptd {digest}\n{machine_line()}"
        )
        print(header, flush=True)
        results: dict[str, list[dict[str, float | None]]] = {t: [] for t in TOOLS}
        for run in range(args.runs):
            for tool in TOOLS:
                dest = work / f"dest-{tool}-{run}"
                m = measure(
                    command(tool, work, watch, ckpt, dest, src),
                    env={k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")},
                    log_dir=work / "logs",
                    label=f"{tool}-{run}",
                    server_pid=None,
                )
                row: dict[str, float | None] = {"wall_s": m.wall_s, "cpu_s": m.cpu_s}
                if m.rc != 0:
                    print(f"  {tool} run {run} failed rc={m.rc}", flush=True)
                    continue
                if tool == "ckptd" and m.stderr is not None:
                    row["commit_s"] = seconds_between(
                        log_events(m.stderr), "checkpoint_complete", "checkpoint_committed"
                    )
                copied = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
                assert copied >= shape.total_bytes, (tool, copied)
                results[tool].append(row)
                print(
                    f"  {tool} run {run}: {m.wall_s:.2f}s, {m.cpu_s:.2f} CPU-s"
                    + (
                        f", complete->committed {row['commit_s']:.2f}s"
                        if row.get("commit_s")
                        else ""
                    ),
                    flush=True,
                )
                shutil.rmtree(dest, ignore_errors=True)
                shutil.rmtree(work / "state", ignore_errors=True)
                subprocess.run(["sync", "-f", str(work)], check=False)
        gib = shape.total_bytes / GIB
        dd_wall = median_of(r["wall_s"] for r in results["dd"])
        lines = [
            "",
            header,
            "",
            "| tool | wall s | MiB/s | CPU s | x dd |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]

        def line(name: str, wall: float | None, cpu: float | None) -> str:
            rate = gib * 1024 / wall if wall else None
            return (
                f"| {name} | {fmt(wall)} | {fmt(rate, '.0f')} | {fmt(cpu)} "
                f"| {fmt(wall / dd_wall if wall and dd_wall else None)} |"
            )

        ck = results["ckptd"]
        lines.append(
            line(
                "ckptd (process)",
                median_of(r["wall_s"] for r in ck),
                median_of(r["cpu_s"] for r in ck),
            )
        )
        lines.append(
            line("ckptd (complete→committed)", median_of(r.get("commit_s") for r in ck), None)
        )
        names = {"rsync": "rsync -a + sync -f", "cp": "cp -r + sync -f", "dd": "ref: dd conv=fsync"}
        for tool in ("rsync", "cp", "dd"):
            rs = results[tool]
            lines.append(
                line(
                    names[tool],
                    median_of(r["wall_s"] for r in rs),
                    median_of(r["cpu_s"] for r in rs),
                )
            )
        print("\n".join(lines))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"header": header, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
