"""A fresh node's start under ``ckptd exec``: restore the run's newest checkpoint into an
empty watch dir, then start the trainer. Shared by ``tests/process/test_fresh_node.py``
(what the trainer is told) and ``bench/bench_fresh_node.py`` (how long it waits).

The trainer is a one-liner that writes what it was told (``CKPTD_RESUME_FROM``) and when it
started; the daemon's JSON log gives when the restore ended (``exec_restored``)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.support.daemon import write_config
from tests.support.trainers.procs import script_env

TRAINER = (
    "import json, os, sys, time; "
    "json.dump({'resume': os.environ.get('CKPTD_RESUME_FROM'), 'at': time.time()}, "
    "open(sys.argv[1], 'w'))"
)


@dataclass(frozen=True)
class FreshStart:
    """What one fresh node's start was: the exit code, what the trainer was told, the
    seconds from the restore's end to the trainer's start, and the daemon's log."""

    code: int
    resume: str | None
    restore_to_start_s: float
    events: list[dict[str, Any]]

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event]


def fresh_start(
    node: Path, dest: str, endpoint: str, *, settle_seconds: float, port: int
) -> FreshStart:
    """One fresh node (``node``, empty) under ``ckptd exec`` with that quiet window."""
    node.mkdir(parents=True)
    config = write_config(
        node / "ckptd.toml",
        watch=[{"dir": node / "run", "run_id": "run", "settle_seconds": settle_seconds}],
        dest=dest,
        endpoint_url=endpoint,
        state_dir=node / "state",
        port=port,
    )
    told = node / "told.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptd",
            "exec",
            "--config",
            str(config),
            "--",
            *(sys.executable, "-c", TRAINER, str(told)),
        ],
        env=script_env(node),
        capture_output=True,
        text=True,
        timeout=180,
    )
    events = []
    for line in done.stderr.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    doc = json.loads(told.read_text()) if told.exists() else {}
    restored = [e for e in events if e.get("event") == "exec_restored"]
    gap = float("nan")
    if restored and "at" in doc:
        ended = datetime.fromisoformat(restored[0]["timestamp"].replace("Z", "+00:00"))
        gap = doc["at"] - ended.timestamp()
    return FreshStart(done.returncode, doc.get("resume"), gap, events)
