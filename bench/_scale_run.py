"""Part 4 of ``bench_scale.py``: one daemon, a long run of small marker checkpoints.

A real ``ckptd run`` (marker layout, ``keep_last = 3``, ``local_keep_last = 3``) commits
``total`` checkpoints one after another; the writer writes one 4 KiB file and the marker,
and waits for ``checkpoint_committed`` (logged after the retention pass) before the next.
Per commit: marker → committed seconds, and the store requests made since the previous
commit (the fault proxy's count; ``None`` on ``file://``, which has no requests to count).
At each size in ``marks`` a row: medians over the ten commits up to it, the daemon's RSS
and its state directory's size. Nothing is fast-forwarded: at 2,000 the store has seen
2,000 commits and 1,997 deletions (SeaweedFS still lists every emptied prefix).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import dir_size, event_time

WINDOW = 10  # commits each row's medians are taken over


@dataclass
class Mark:
    commits: int
    latency_s: float
    requests: float | None
    rss_mib: float
    state_kib: float
    fds: int


class LogTail:
    """The ``checkpoint_committed`` times of a growing JSON log, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.committed: dict[str, float] = {}

    def poll(self) -> None:
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if b"checkpoint_committed" not in line:
                continue
            try:
                doc: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            if doc.get("event") == "checkpoint_committed":
                self.committed[str(doc.get("checkpoint"))] = event_time(doc)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def config(work: Path, dest: str, endpoint: str | None, port: int) -> Path:
    lines = [
        "[[watch]]",
        f"dir = {json.dumps(str(work / 'run'))}",
        'run_id = "run"',
        'layout = "marker"',
        "settle_seconds = 0",
        "[destination]",
        f"url = {json.dumps(dest)}",
        *([f"endpoint_url = {json.dumps(endpoint)}"] if endpoint else []),
        "[retention]",
        "keep_last = 3",
        "local_keep_last = 3",
        "[preemption]",
        'provider = "none"',
        "[metrics]",
        f'listen = "127.0.0.1:{port}"',
        "[state]",
        f"dir = {json.dumps(str(work / 'state'))}",
    ]
    path = work / "ckptd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1):
                return
        except OSError as exc:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"ckptd did not start:\n{log.read_text()[-2000:]}") from exc
            time.sleep(0.1)


def long_run(
    work: Path,
    *,
    dest: str,
    endpoint: str | None,
    port: int,
    total: int,
    marks: Sequence[int],
    count_requests: Callable[[], int] | None,
    env: dict[str, str],
    progress: Callable[[str], None],
    command: Sequence[str] = (sys.executable, "-m", "ckptd"),
) -> list[Mark]:
    """``command`` runs ckptd (``common.ckptd_command``: as installed, or another
    version's source, for a side-by-side run)."""
    work.mkdir(parents=True)
    (work / "run").mkdir()
    cfg = config(work, dest, endpoint, port)
    log_path = work / "ckptd.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*command, "run", "--config", str(cfg)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    tail = LogTail(log_path)
    latencies: list[float] = []
    requests: list[int] = []
    out: list[Mark] = []
    try:
        wait_ready(port, proc, log_path)
        before = count_requests() if count_requests else 0
        for k in range(1, total + 1):
            name = f"step-{k}"
            ckpt = work / "run" / name
            ckpt.mkdir()
            (ckpt / "model.bin").write_bytes(os.urandom(4096))
            t0 = time.time()
            (ckpt / "COMPLETE").write_text("")
            deadline = time.monotonic() + 120
            while name not in tail.committed:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{name} not committed:\n{log_path.read_text()[-2000:]}")
                time.sleep(0.01)
                tail.poll()
            latencies.append(tail.committed.pop(name) - t0)
            if count_requests:
                now = count_requests()
                requests.append(now - before)
                before = now
            if k in marks:
                window = latencies[-WINDOW:]
                reqs = requests[-WINDOW:]
                mark = Mark(
                    k,
                    statistics.median(window),
                    statistics.median(reqs) if reqs else None,
                    rss_mib(proc.pid),
                    dir_size(work / "state") / 1024,
                    len(os.listdir(f"/proc/{proc.pid}/fd")),
                )
                out.append(mark)
                progress(f"{dest}: {mark}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out


def table(store: str, marks: Sequence[Mark]) -> list[str]:
    first = marks[0].latency_s if marks else None
    rows = [
        "| store | commits | marker→committed s (median of last 10) | ratio to the first row "
        "| requests per commit (median) | daemon RSS MiB | state dir KiB | fds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in marks:
        ratio = "-" if not first else f"{m.latency_s / first:.2f}"
        reqs = "-" if m.requests is None else f"{m.requests:.0f}"
        rows.append(
            f"| {store} | {m.commits} | {m.latency_s:.3f} | {ratio} | {reqs} "
            f"| {m.rss_mib:.0f} | {m.state_kib:.0f} | {m.fds} |"
        )
    return rows
