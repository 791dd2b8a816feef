"""What every campaign runs against: one SeaweedFS, the fault proxy in front of it, a
work dir, and the daemon's config file; plus the table every campaign prints."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3
from tests.campaigns.checker import StoreChecker
from tests.support.faultproxy import FaultProxy

BUCKET = "ckpt"
MiB = 1 << 20


@dataclass
class Stage:
    """A running store and proxy for one campaign, and where it may write."""

    s3: LocalS3
    proxy: FaultProxy
    work: Path

    def checker(self, prefix: str) -> StoreChecker:
        # Straight to the store, not through the proxy: the judge sees no faults.
        return StoreChecker(self.s3.endpoint_url, BUCKET, prefix, self.s3.env())

    def daemon_env(self) -> dict[str, str]:
        return {**self.s3.env(), "AWS_EC2_METADATA_DISABLED": "true"}


@contextmanager
def stage(work: Path, s3: LocalS3 | None = None, stall_seconds: float = 2.0) -> Iterator[Stage]:
    """A stage on ``s3`` (a SeaweedFS of its own under ``work`` when None)."""
    work.mkdir(parents=True, exist_ok=True)
    own = s3 is None
    server = s3 if s3 is not None else LocalS3(work / "seaweedfs", buckets=(BUCKET,)).start()
    proxy = FaultProxy(server.endpoint_url, stall_seconds=stall_seconds).start()
    try:
        yield Stage(server, proxy, work)
    finally:
        proxy.stop()
        if own:
            server.stop()


def write_daemon_config(
    path: Path,
    *,
    watch: Path,
    dest: str,
    endpoint_url: str,
    state_dir: Path,
    port: int,
    settle_seconds: float = 0.3,
    keep_last: int = 0,
    **destination: Any,
) -> Path:
    lines = [
        "[[watch]]",
        f"dir = {json.dumps(str(watch))}",
        f"settle_seconds = {settle_seconds}",
        "[destination]",
        f"url = {json.dumps(dest)}",
        f"endpoint_url = {json.dumps(endpoint_url)}",
        *(f"{k} = {json.dumps(v)}" for k, v in destination.items()),
        "[retention]",
        f"keep_last = {keep_last}",
        "[preemption]",
        'provider = "none"',
        "[metrics]",
        f'listen = "127.0.0.1:{port}"',
        "[state]",
        f"dir = {json.dumps(str(state_dir))}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (what docs/guarantees.md's campaign figures quote), with a title line."""
    out = [f"\n{title}", "| " + " | ".join(header) + " |"]
    out.append("| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |")
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def machine() -> str:
    cpus = os.cpu_count() or 0
    return f"{cpus} CPUs, {time.strftime('%Y-%m-%d', time.gmtime())} UTC"
