"""How ckptd's cost grows with the number of files and of committed checkpoints.

```sh
.venv/bin/python bench/bench_scale.py                 # full (~5-10 min on 2 cores)
.venv/bin/python bench/bench_scale.py --quick         # smaller sizes, fewer trials
```

Against one loopback SeaweedFS (``ckptd.devtools.locals3``), three measurements:

1. Many small files in one checkpoint (HF layout, ``trainer_state.json`` written last,
   ``settle_seconds = 0``): ``python -m ckptd run --once`` split into phases by its JSON
   log events (``ckptd_ready``, ``checkpoint_complete``, ``checkpoint_uploading``,
   ``checkpoint_verified``, ``checkpoint_committed``), at several file counts.
2. Many committed checkpoints in one run (seeded directly with boto3 in ckptd's remote
   layout): ``ckptd list --run R --json`` (process), ``list_committed`` (in-process),
   ``apply_retention`` down to 5, and the pure ``plan_retention`` on synthetic entries.
3. Marker-created → ``checkpoint_uploading`` latency of a running daemon (marker layout).
4. A long run (``bench/_scale_run.py``): one daemon commits 2,000 marker checkpoints
   (``keep_last = 3``) to SeaweedFS behind the fault proxy and to ``file://``: commit
   latency, store requests per commit, RSS and state dir at 10, 100, 1,000 and 2,000.
5. The fleet (``bench/_scale_fleet.py``): 16, 32, 64 daemons, ``[cluster] nodes = N``,
   one store: idle requests per node per minute, one sharded checkpoint's last part →
   global commit and requests, memory per daemon, and what it costs on AWS S3.

```sh
.venv/bin/python bench/bench_scale.py --parts 4 --run-length 2000 --stores s3,file
.venv/bin/python bench/bench_scale.py --parts 5 --fleet 16,32,64
```
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # and tests.support

from _scale_fleet import fleet_tables, measure_fleet
from _scale_run import long_run
from _scale_run import table as run_table
from common import (
    BUCKET,
    ckptd_command,
    event_time,
    fmt,
    log_events,
    snapshot_ckptd,
    snapshot_revision,
)

from ckptd.core import checksum
from ckptd.core.manifest import Latest, build_manifest
from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.repository import Repository, latest_key, manifest_key, object_key
from ckptd.runtime import logs
from ckptd.storage import open_storage
from ckptd.store.retention import apply_retention, plan_retention

PY = sys.executable
FILE_SIZE = 4096


# --- machine and log helpers -----------------------------------------------------------


def machine_header() -> list[str]:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = Path("/proc/loadavg").read_text().split()[:3]
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return [
        f"- machine: nproc {os.cpu_count()}, CPU {model}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}",
        f"- date: {now}; load average at start: {' '.join(load)}",
    ]


def load_now() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def first(events: Sequence[dict[str, Any]], name: str, **match: str) -> dict[str, Any] | None:
    for e in events:
        if e.get("event") == name and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


# --- 1. many small files ---------------------------------------------------------------


def write_many_files(ckpt: Path, n: int) -> None:
    """``n`` files of 4 KiB in nested dirs (100 per leaf dir), then ``trainer_state.json``."""
    ckpt.mkdir(parents=True)
    for i in range(n):
        d = ckpt / f"layer_{i // 1000:02d}" / f"block_{(i // 100) % 10:02d}"
        if i % 100 == 0:
            d.mkdir(parents=True, exist_ok=True)
        (d / f"shard_{i:05d}.bin").write_bytes(os.urandom(FILE_SIZE))
    (ckpt / "config.json").write_text("{}")
    # The weights index (the hf rule wants weights, as the Trainer's loader does).
    (ckpt / "model.safetensors.index.json").write_text("{}")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 500}))


def run_once(
    work: Path, server: LocalS3, n: int, timeout: float
) -> tuple[dict[str, float | None], str]:
    tag = f"files{n}-{int(time.time() * 1000)}"
    watch = work / tag / "run"
    write_many_files(watch / "checkpoint-500", n)
    subprocess.run(["sync"], check=False)
    cfg = work / f"{tag}.toml"
    cfg.write_text(
        "[[watch]]\n"
        f'dir = "{watch}"\n'
        'run_id = "run"\n'
        'layout = "hf"\n'
        "settle_seconds = 0\n"
        "[destination]\n"
        f'url = "s3://{BUCKET}/{tag}"\n'
        f'endpoint_url = "{server.endpoint_url}"\n'
        "[preemption]\n"
        'provider = "none"\n'
        "[metrics]\n"
        f'listen = "127.0.0.1:{free_port()}"\n'
        "[state]\n"
        f'dir = "{work / tag / "state"}"\n'
    )
    err = work / f"{tag}.stderr"
    t0 = time.time()
    with err.open("wb") as ef:
        try:
            proc = subprocess.run(
                [PY, "-m", "ckptd", "run", "--once", "--config", str(cfg)],
                stdout=subprocess.DEVNULL,
                stderr=ef,
                timeout=timeout,
                check=False,
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    t_exit = time.time()
    ev = log_events(err)
    marks = {
        name: (lambda e: event_time(e) if e else None)(first(ev, name))
        for name in (
            "ckptd_starting",
            "checkpoint_detected",
            "checkpoint_complete",
            "checkpoint_uploading",
            "checkpoint_verified",
            "checkpoint_committed",
        )
    }

    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    out: dict[str, float | None] = {
        "start": diff(t0, marks["ckptd_starting"]),
        "scan": diff(marks["ckptd_starting"], marks["checkpoint_detected"]),
        "detect": diff(marks["checkpoint_detected"], marks["checkpoint_complete"]),
        "plan": diff(marks["checkpoint_complete"], marks["checkpoint_uploading"]),
        "upload": diff(marks["checkpoint_uploading"], marks["checkpoint_verified"]),
        "commit": diff(marks["checkpoint_verified"], marks["checkpoint_committed"]),
        "exit": diff(marks["checkpoint_committed"], t_exit),
        "wall": t_exit - t0,
    }
    shutil.rmtree(work / tag, ignore_errors=True)
    status = f"rc={rc}"
    if rc != 0:
        tail = err.read_text(errors="replace").splitlines()[-3:]
        status += " " + " / ".join(tail)[:300]
    return out, status


def bench_files(work: Path, server: LocalS3, counts: Sequence[int]) -> list[str]:
    rows = []
    notes = []
    for n in counts:
        r, status = run_once(work, server, n, timeout=300)
        if not status.startswith("rc=0"):
            notes.append(f"- {n} files: {status}")
        per_file = (
            None
            if r["upload"] is None
            else (r["plan"] or 0) + r["upload"] + (r["scan"] or 0) + (r["detect"] or 0)
        )
        rows.append(
            [
                str(n),
                fmt(r["start"]),
                fmt(r["scan"]),
                fmt(r["detect"]),
                fmt(r["plan"]),
                fmt(r["upload"]),
                fmt(r["commit"]),
                fmt(r["exit"]),
                fmt(r["wall"]),
                fmt(None if r["upload"] is None else r["upload"] / n * 1000, ".3f"),
                fmt(None if per_file is None else per_file / n * 1000, ".3f"),
                load_now(),
            ]
        )
        print(f"  files {n}: {r} {status}", file=sys.stderr, flush=True)
    head = [
        "files",
        "process start→`ckptd_starting` s",
        "starting→detected s (dest check+recover+scan)",
        "detected→complete s (rule)",
        "complete→uploading s (plan)",
        "uploading→verified s (upload)",
        "verified→committed s (commit)",
        "committed→exit s",
        "process wall s",
        "upload ms/file",
        "scan+plan+upload ms/file",
        "load after",
    ]
    return table(head, rows) + notes


# --- 2. many committed checkpoints -----------------------------------------------------


def seed_run(client: Any, prefix: str, run: str, n: int) -> None:
    """``n`` committed checkpoints of two tiny files each, plus LATEST, written directly."""
    env = {"ckptd": "bench", "python": platform.python_version()}
    now = time.time()
    bodies = {"config.json": b'{"a": 1}\n', "model.bin": os.urandom(256)}
    crcs = {p: checksum.to_hex(checksum.crc32c(b)) for p, b in bodies.items()}
    last: tuple[str, int, bytes] | None = None

    def one(i: int) -> tuple[str, int, bytes]:
        step = (i + 1) * 10
        name = f"checkpoint-{step}"
        for path, body in bodies.items():
            client.put_object(
                Bucket=BUCKET, Key=f"{prefix}/{object_key(run, name, path)}", Body=body
            )
        manifest = build_manifest(
            run_id=run,
            checkpoint=name,
            step=step,
            layout="hf",
            host="bench",
            created_at=now + i,
            committed_at=now + i,
            files=[(p, len(b), crcs[p]) for p, b in bodies.items()],
            environment=env,
        ).to_bytes()
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{manifest_key(run, name)}", Body=manifest)
        return name, step, manifest

    with ThreadPoolExecutor(max_workers=16) as pool:
        for result in pool.map(one, range(n)):
            last = result
    assert last is not None
    name, step, manifest = last
    latest = Latest(
        checkpoint=name, step=step, manifest_crc32c=checksum.to_hex(checksum.crc32c(manifest))
    )
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{latest_key(run)}", Body=latest.to_bytes())


def bench_many(server: LocalS3, counts: Sequence[int]) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=server.endpoint_url)
    prefix = f"many-{int(time.time())}"
    url = f"s3://{BUCKET}/{prefix}"
    storage = open_storage(url, endpoint_url=server.endpoint_url)
    rows = []
    for n in counts:
        run = f"run{n}"
        t = time.perf_counter()
        seed_run(client, prefix, run, n)
        seed_s = time.perf_counter() - t

        t = time.perf_counter()
        proc = subprocess.run(
            [
                PY, "-m", "ckptd", "list", "--dest", url,
                "--endpoint-url", server.endpoint_url, "--run", run, "--json",
            ],
            capture_output=True,
            check=False,
            timeout=300,
        )  # fmt: skip
        cli_s = time.perf_counter() - t
        listed = "?"
        if proc.returncode == 0:
            try:
                doc = json.loads(proc.stdout)
                listed = str(
                    len(doc) if isinstance(doc, list) else len(doc.get("checkpoints", doc))
                )
            except ValueError:
                listed = f"{len(proc.stdout.splitlines())} lines"
        else:
            listed = f"rc={proc.returncode}: {proc.stderr.decode(errors='replace')[-200:]}"

        t = time.perf_counter()
        committed = Repository(storage).list_committed(run)
        lc_s = time.perf_counter() - t

        t = time.perf_counter()
        deleted = apply_retention(storage, run, keep_last=5, keep_every_steps=0)
        ret_s = time.perf_counter() - t
        left = len(Repository(storage).list_committed(run))
        rows.append(
            [
                str(n),
                fmt(seed_s),
                fmt(cli_s),
                listed,
                fmt(lc_s),
                fmt(lc_s / n * 1000),
                str(len(committed)),
                fmt(ret_s),
                fmt(ret_s / max(1, len(deleted)) * 1000),
                f"{len(deleted)} / {left}",
            ]
        )
        print(f"  many {n}: {rows[-1]}", file=sys.stderr, flush=True)
    head = [
        "checkpoints",
        "seed s (boto3, 16 threads)",
        "`ckptd list --run --json` s",
        "listed",
        "list_committed s",
        "list_committed ms/ckpt",
        "found",
        "apply_retention s",
        "ms/deleted ckpt",
        "deleted / left",
    ]
    return table(head, rows)


def bench_plan(sizes: Sequence[int]) -> list[str]:
    rows = []
    for n in sizes:
        entries = [(f"checkpoint-{(i + 1) * 10}", (i + 1) * 10) for i in range(n)]
        best = float("inf")
        victims: list[str] = []
        for _ in range(5):
            t = time.perf_counter()
            victims = plan_retention(
                entries, keep_last=5, keep_every_steps=1000, protected={entries[0][0]}
            )
            best = min(best, time.perf_counter() - t)
        rows.append(
            [str(n), fmt(best * 1000, ".3f"), fmt(best / n * 1e9, ".0f"), str(len(victims))]
        )
    return table(["entries", "plan_retention ms (best of 5)", "ns/entry", "victims"], rows)


# --- 3. marker → uploading latency -----------------------------------------------------


def wait_http(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return True
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.1)
    return False


def bench_latency(work: Path, server: LocalS3, trials: int) -> list[str]:
    watch = work / "lat" / "latrun"
    watch.mkdir(parents=True)
    port = free_port()
    cfg = work / "lat.toml"
    cfg.write_text(
        "[[watch]]\n"
        f'dir = "{watch}"\n'
        'layout = "marker"\n'
        "[destination]\n"
        f'url = "s3://{BUCKET}/lat-{int(time.time())}"\n'
        f'endpoint_url = "{server.endpoint_url}"\n'
        "[retention]\n"
        "keep_last = 0\n"
        "[preemption]\n"
        'provider = "none"\n'
        "[metrics]\n"
        f'listen = "127.0.0.1:{port}"\n'
        "[state]\n"
        f'dir = "{work / "lat" / "state"}"\n'
    )
    err = work / "lat.stderr"
    ef = err.open("wb")
    proc = subprocess.Popen(
        [PY, "-m", "ckptd", "run", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=ef,
    )
    rows = []
    lat_upl: list[float] = []
    lat_cmp: list[float] = []
    try:
        if not wait_http(port, 60):
            return [f"daemon not ready; stderr tail: {err.read_text()[-500:]}"]
        time.sleep(0.5)
        for k in range(trials):
            name = f"step-{(k + 1) * 100}"
            ckpt = watch / name
            ckpt.mkdir()
            (ckpt / "model.bin").write_bytes(os.urandom(64 * 1024))
            (ckpt / "meta.json").write_text("{}")
            time.sleep(0.5)  # past the 0.2 s debounce of the data files' events
            t0 = time.time()
            (ckpt / "COMPLETE").write_text("")
            deadline = time.monotonic() + 30
            done = None
            while time.monotonic() < deadline:
                ev = log_events(err)
                done = first(ev, "checkpoint_committed", checkpoint=name)
                if done is not None:
                    break
                time.sleep(0.05)
            ev = log_events(err)
            up = first(ev, "checkpoint_uploading", checkpoint=name)
            cp = first(ev, "checkpoint_complete", checkpoint=name)
            d_up = None if up is None else event_time(up) - t0
            d_cp = None if cp is None else event_time(cp) - t0
            d_cm = None if done is None else event_time(done) - t0
            if d_up is not None:
                lat_upl.append(d_up)
            if d_cp is not None:
                lat_cmp.append(d_cp)
            rows.append([str(k + 1), name, fmt(d_cp, ".3f"), fmt(d_up, ".3f"), fmt(d_cm, ".3f")])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ef.close()
    out = table(
        ["trial", "checkpoint", "marker→complete s", "marker→uploading s", "marker→committed s"],
        rows,
    )

    def summ(xs: list[float]) -> str:
        if not xs:
            return "-"
        return f"median {statistics.median(xs):.3f} s, max {max(xs):.3f} s (n={len(xs)})"

    out += [
        "",
        f"- marker→complete: {summ(lat_cmp)}",
        f"- marker→uploading: {summ(lat_upl)}",
    ]
    return out


# --- 4. a long run ----------------------------------------------------------------------


def say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def bench_long_run(
    work: Path, server: LocalS3, total: int, stores: Sequence[str], baseline: str | None
) -> list[str]:
    """Part 4; with ``baseline`` (a git revision) the same run with that version's ckptd
    too, the two interleaved store by store, each row labelled with its version."""
    from tests.support.faultproxy import FaultProxy

    marks = [m for m in (10, 100, 1000, 2000) if m <= total] or [total]
    env = {**os.environ, **server.env(), "PYTHONUNBUFFERED": "1"}
    versions: list[tuple[str, list[str]]] = []
    src, digest = snapshot_ckptd(work / "ckptd-now")
    versions.append((f"now ({digest})", ckptd_command(src)))
    if baseline:
        old, old_digest = snapshot_revision(baseline, work / "ckptd-baseline")
        versions.append((f"{baseline} ({old_digest})", ckptd_command(old)))
    out = [f"## 4. A long run: {total} marker checkpoints, keep_last = 3, one daemon", ""]
    first = True
    for store in stores:
        for label, command in versions:
            tag = f"long-{store}-{len(out)}-{int(time.time())}"
            if store == "s3":
                with FaultProxy(server.endpoint_url) as proxy:
                    found = long_run(
                        work / tag, dest=f"s3://{BUCKET}/{tag}", endpoint=proxy.url,
                        port=free_port(), total=total, marks=marks,
                        count_requests=proxy.count, env=env, progress=say, command=command,
                    )  # fmt: skip
            else:
                found = long_run(
                    work / tag, dest=(work / tag / "store").as_uri(), endpoint=None,
                    port=free_port(), total=total, marks=marks, count_requests=None,
                    env=env, progress=say, command=command,
                )  # fmt: skip
            name = "SeaweedFS" if store == "s3" else "file://"
            rows = run_table(f"{name}, {label}" if baseline else name, found)
            out += rows if first else rows[2:]
            first = False
    return [*out, ""]


# --- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer trials")
    ap.add_argument("--files", default="", help="comma list of file counts (part 1)")
    ap.add_argument("--checkpoints", default="", help="comma list of checkpoint counts (part 2)")
    ap.add_argument("--trials", type=int, default=0, help="latency trials (part 3)")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--run-length", type=int, default=2000, help="commits (part 4)")
    ap.add_argument("--stores", default="s3,file", help="stores of part 4: s3, file")
    ap.add_argument(
        "--baseline",
        default=None,
        help="part 4: also run this git revision's ckptd, side by side (e.g. 218b27b)",
    )
    ap.add_argument("--fleet", default="16,32,64", help="daemon counts (part 5)")
    ap.add_argument("--idle-seconds", type=float, default=60.0, help="idle window (part 5)")
    args = ap.parse_args(argv)

    files = [int(x) for x in args.files.split(",") if x] or (
        [300, 1000] if args.quick else [1000, 3000, 10000]
    )
    ckpts = [int(x) for x in args.checkpoints.split(",") if x] or (
        [30, 100] if args.quick else [100, 300, 1000]
    )
    trials = args.trials or (3 if args.quick else 10)
    parts = set(args.parts.split(","))

    work = Path(tempfile.mkdtemp(prefix="ckptd-scale-", dir=args.workdir))
    server = LocalS3(work / "s3").start()
    os.environ.update(server.env())
    logs.configure("warning", json=True)  # in-process retention would log every deletion
    lines = ["# ckptd scale benchmark", "", *machine_header(), ""]
    t_all = time.time()
    try:
        if "1" in parts:
            lines += [f"## 1. One checkpoint of N x {FILE_SIZE} B files (hf layout, settle 0)", ""]
            lines += bench_files(work, server, files)
            lines.append("")
        if "2" in parts:
            lines += ["## 2. Many committed checkpoints (2 tiny files each)", ""]
            lines += bench_many(server, ckpts)
            lines += ["", "`plan_retention` (pure, keep_last=5, keep_every_steps=1000):", ""]
            lines += bench_plan([1_000, 10_000, 100_000])
            lines.append("")
        if "3" in parts:
            lines += [
                f"## 3. Marker → upload-started latency, running daemon ({trials} trials)",
                "",
            ]
            lines += bench_latency(work, server, trials)
            lines.append("")
        if "4" in parts:
            lines += bench_long_run(
                work, server, args.run_length, args.stores.split(","), args.baseline
            )
        if "5" in parts:
            counts = [int(x) for x in args.fleet.split(",") if x]
            rows = [measure_fleet(work, server, n, args.idle_seconds, say) for n in counts]
            lines += ["## 5. The fleet: N daemons, one store", "", *fleet_tables(rows), ""]
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    lines.append(f"total bench time {time.time() - t_all:.0f} s; load average at end {load_now()}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
