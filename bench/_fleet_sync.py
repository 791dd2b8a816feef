"""The fleet campaign's ``sync-loop`` policy: what platforms document without ckptd. The
trainer's own periodic saves (``save_steps``) go into its node dir; a loop per node copies
complete-looking step dirs to the store every few seconds (an ``aws s3 sync`` / rsync
cron, here boto3's ``upload_file`` in a small process inside the node's namespace, so its
traffic crosses the node's and the store's links); a relaunch is a blind restart from the
newest step prefix in the store, downloaded whole (from the campaign process, over the
store's link), without verification.

"Complete-looking", as such a script decides it: every file of the step dir unchanged for
``settle`` seconds, and on node 0 DCP's ``.metadata`` there. After its files, each loop puts
``step-N/.copied-<rank>``; the campaign counts step N copied once every rank's marker is
there (``commits.jsonl``, the figures' "expected step").

The invariant: the loop never uploads a file twice, and nothing here checks a byte.

Run as ``python -m bench._fleet_sync --dir D --rank R --endpoint URL --prefix P``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import s3_client
from tests.support.peer_cluster import BUCKET, PeerRig

_STEP_DIR = re.compile(r"^step-(\d+)$")


def looks_complete(step_dir: Path, rank: int, settle: float) -> bool:
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    if not files or (rank == 0 and not (step_dir / ".metadata").exists()):
        return False
    newest = max(p.stat().st_mtime for p in files)
    return time.time() - newest >= settle


def loop(o: argparse.Namespace) -> None:
    s3 = s3_client(o.endpoint)
    done: set[str] = set()
    while True:
        for step_dir in sorted(o.dir.glob("step-*")):
            if step_dir.name in done or not _STEP_DIR.match(step_dir.name):
                continue
            with contextlib.suppress(OSError):
                if not looks_complete(step_dir, o.rank, o.settle):
                    continue
                for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
                    key = f"{o.prefix}/{step_dir.name}/{path.relative_to(step_dir).as_posix()}"
                    s3.upload_file(str(path), BUCKET, key)
                s3.put_object(Bucket=BUCKET, Key=f"{o.prefix}/{step_dir.name}/.copied-{o.rank}")
                done.add(step_dir.name)
        time.sleep(o.every)


class SyncLoops:
    """One loop per host (started on each launch where missing), and the blind restart."""

    def __init__(self, prig: PeerRig) -> None:
        self.prig = prig
        self.prefix = f"{prig.prefix}/sync"
        self.procs: dict[str, Any] = {}

    def follow(self, cluster: Any) -> None:
        import subprocess
        import sys

        from bench._fleet_cluster import REPO
        from tests.support.daemon import die_with_parent

        for slot in cluster.slots:
            if slot.host is None or slot.root is None:
                continue
            name = slot.host.ns
            if name in self.procs and self.procs[name].poll() is None:
                continue
            log = (slot.root / "sync-loop.log").open("ab")
            self.procs[name] = subprocess.Popen(
                slot.host.argv(
                    [
                        sys.executable, "-m", "bench._fleet_sync", "--dir", str(slot.node_dir),
                        "--rank", str(slot.rank), "--endpoint", self.prig.s3.endpoint_url,
                        "--prefix", self.prefix,
                    ]
                ),
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO,
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
            log.close()

    def newest(self) -> int | None:
        s3 = self.prig.client()
        steps = set()
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=f"{self.prefix}/", Delimiter="/"
        ):
            for common in page.get("CommonPrefixes", []):
                match = re.search(r"/step-(\d+)/$", common["Prefix"])
                if match:
                    steps.add(int(match.group(1)))
        return max(steps) if steps else None

    def blind_restore(self, cluster: Any) -> dict[int, Path] | None:
        """The newest step in the store, downloaded whole into every node's dir."""
        step = self.newest()
        if step is None:
            return None
        s3 = self.prig.client()
        name = f"step-{step}"
        keys = [
            item["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket=BUCKET, Prefix=f"{self.prefix}/{name}/"
            )
            for item in page.get("Contents", [])
            if "/.copied-" not in item["Key"]
        ]
        resume = {}
        for slot in cluster.slots:
            target = slot.node_dir / name
            for key in keys:
                path = target / key.split(f"/{name}/", 1)[1]
                path.parent.mkdir(parents=True, exist_ok=True)
                s3.download_file(BUCKET, key, str(path))
            resume[slot.rank] = target
        return resume

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--every", type=float, default=2.0)
    p.add_argument("--settle", type=float, default=1.0)
    loop(p.parse_args())


if __name__ == "__main__":
    main()
