"""What the store holds, as the fleet campaign's figures need it: a thread that lists the
run's committed checkpoints every ``interval`` seconds and appends
``{"kind": "commit", "t", "step"}`` to ``<out>/<policy>/commits.jsonl`` the first time it
sees each step committed (a ``ckptd.manifest.json`` under ``<prefix>/<run>/step-N/``, or,
for the sync loop, the loop's own record that it copied step N).

The invariant: a commit row's ``t`` is no earlier than the commit (it is when the watcher
first saw it, at most ``interval`` plus a listing late).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

from tests.support.peer_cluster import BUCKET, RUN_ID

_STEP = re.compile(r"/step-(\d+)[^/]*/ckptd\.manifest\.json$")
_COPIED = re.compile(r"/sync/step-(\d+)/\.copied-(\d+)$")


class CommitWatcher:
    def __init__(
        self, client: Any, prefix: str, out: Path, interval: float = 0.5, *, copied_by: int = 0
    ) -> None:
        """``copied_by`` N: the sync loop's markers, a step counted once N ranks copied it."""
        self.client = client
        self.copied_by = copied_by
        self.prefix = f"{prefix}/sync/" if copied_by else f"{prefix}/{RUN_ID}/"
        self.path = out / "commits.jsonl"
        self.interval = interval
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="commits", daemon=True)

    def start(self) -> CommitWatcher:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # the store busy or gone: next round
                self.look()

    def look(self) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=self.prefix
        )
        found: set[int] = set()
        ranks: dict[int, set[int]] = {}
        for page in pages:
            for item in page.get("Contents", []):
                if self.copied_by:
                    copied = _COPIED.search(item["Key"])
                    if copied:
                        ranks.setdefault(int(copied.group(1)), set()).add(int(copied.group(2)))
                    continue
                match = _STEP.search(item["Key"])
                if match:
                    found.add(int(match.group(1)))
        found |= {step for step, who in ranks.items() if len(who) >= self.copied_by}
        for step in sorted(found - self.seen):
            self.seen.add(step)
            with self.path.open("a") as fh:
                fh.write(json.dumps({"kind": "commit", "t": time.time(), "step": step}) + "\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
