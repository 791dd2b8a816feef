"""Two ``ckptd run --once`` racing on one checkpoint name: the harness of the race tests
(``tests/process/test_commit_races.py``) and of the race campaign
(``python -m tests.campaigns races``).

Two writers, each with its own watch dir and state dir, the same run id and the same
checkpoint name (``checkpoint-60``), different bytes, uploads rate-capped so that they
overlap. Optionally one of them is killed with ``kill -9`` at a seeded instant and started
again. The verdict is read from the store itself: the committed checkpoint's objects are
read back one by one and compared with each writer's local files."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.errors import EXIT_FAILED
from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from ckptd.storage.base import NotFoundError
from ckptd.store.verify import verify_checkpoint
from tests.support.writers import local_files, write_hf

NAME = "checkpoint-60"
RUN = "run"
# Each writer's checkpoint, and the cap on each one's uploads: ~1.5 s of upload each, so
# two started together overlap for most of it.
MODEL_BYTES = 6 << 20
CAP_MIB_PER_S = 4.0
# Runs again of a racer whose `--once` failed for another reason than a conflict.
RETRIES = 2


@dataclass
class Racer:
    """One writer: its watch dir, state dir, config, and its ``--once`` runs' results."""

    label: str
    root: Path
    config: Path
    codes: list[int] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    killed_at: float | None = None
    retried: int = 0  # runs again after the store failed it (run_race)

    @property
    def files(self) -> dict[str, bytes]:
        return local_files(self.root / "watch" / NAME)

    def start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "ckptd", "run", "--once", "--config", str(self.config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def finish(self, proc: subprocess.Popen[str], timeout: float) -> None:
        out, _ = proc.communicate(timeout=timeout)
        self.codes.append(proc.returncode)
        self.output.append(out)
        # Kept beside the racer's dirs: a campaign's problem is read from these.
        (self.root / f"once-{len(self.output)}.log").write_text(out)


def racer(tmp: Path, label: str, dest: str, endpoint: str) -> Racer:
    root = tmp / label
    watch = root / "watch"
    write_hf(watch, 60, model_bytes=MODEL_BYTES)
    config = root / "ckptd.toml"
    lines = [
        "[[watch]]",
        f"dir = {json.dumps(str(watch))}",
        f'run_id = "{RUN}"',
        "settle_seconds = 0",
        "[destination]",
        f"url = {json.dumps(dest)}",
        f"endpoint_url = {json.dumps(endpoint)}",
        f"max_upload_mib_per_s = {CAP_MIB_PER_S}",
        "[preemption]",
        'provider = "none"',
        "[metrics]",
        'listen = "127.0.0.1:0"',
        "[state]",
        f"dir = {json.dumps(str(root / 'state'))}",
    ]
    config.write_text("\n".join(lines) + "\n")
    return Racer(label, root, config)


@dataclass
class RaceVerdict:
    """What a race left: who won, and every problem found (none is a pass)."""

    winner: str | None
    problems: list[str]
    racers: list[Racer]

    def describe(self) -> str:
        codes = ", ".join(
            f"{r.label}: {r.codes}" + (f" ({r.retried} after a store failure)" if r.retried else "")
            for r in self.racers
        )
        kill = next(
            (f"{r.label} killed at {r.killed_at:.2f}s" for r in self.racers if r.killed_at), ""
        )
        return f"winner {self.winner}; exit codes {codes} {kill}".strip()


def run_race(
    tmp: Path, dest: str, endpoint: str, rng: random.Random, *, kill: bool, timeout: float = 180
) -> RaceVerdict:
    """One race (module doc); ``kill``: one racer, chosen by ``rng``, is killed with
    ``kill -9`` at an instant ``rng`` draws in the first ~2.5 s of the race, then run again."""
    tmp.mkdir(parents=True, exist_ok=True)
    a, b = racer(tmp, "a", dest, endpoint), racer(tmp, "b", dest, endpoint)
    procs = {"a": a.start(), "b": b.start()}
    started = time.monotonic()
    if kill:
        victim = rng.choice([a, b])
        at = rng.uniform(0.3, 2.5)
        while time.monotonic() - started < at and procs[victim.label].poll() is None:
            time.sleep(0.01)
        if procs[victim.label].poll() is None:
            procs[victim.label].send_signal(signal.SIGKILL)
            victim.killed_at = time.monotonic() - started
        victim.finish(procs[victim.label], timeout)
        procs[victim.label] = victim.start()  # restarted at once, as a supervisor would
    for r in (a, b):
        r.finish(procs[r.label], timeout)
    # A racer whose store failed it (the store timing out on a loaded machine, say:
    # `checkpoint_failed` with reason storage) is run again, as whatever runs `--once` on
    # a node would. Counted (``retried``); any other failure stands, for the judge.
    for r in (a, b):
        for _ in range(RETRIES):
            if r.codes[-1] != EXIT_FAILED or '"reason": "storage"' not in r.output[-1]:
                break
            r.retried += 1
            r.finish(r.start(), timeout)
    return judge(dest, endpoint, [a, b])


def judge(dest: str, endpoint: str, racers: list[Racer]) -> RaceVerdict:
    """The store's verdict on a race: exactly one writer's bytes are committed, whole and
    verified; that writer exited 0 and the other exited 1 saying conflict."""
    problems: list[str] = []
    repo = Repository(open_backend(dest, endpoint_url=endpoint))
    try:
        manifest = repo.resolve(RUN, NAME)
    except NotFoundError:
        why = [f"{r.label}: {_failure(r.output[-1])}" for r in racers if r.output]
        return RaceVerdict(None, [f"nothing committed ({'; '.join(why)})"], racers)
    stored = {
        f.path: repo.storage.get_bytes(object_key(RUN, manifest.checkpoint, f.path))
        for f in manifest.files
    }
    owners = [r for r in racers if r.files == stored]
    if len(owners) != 1:
        mixed = {
            path: [r.label for r in racers if r.files.get(path) == data]
            for path, data in stored.items()
        }
        problems.append(f"committed bytes belong to {len(owners)} writers: {mixed}")
    problems += [f"verify: {p}" for p in verify_checkpoint(repo.storage, manifest)]
    winner = owners[0] if len(owners) == 1 else None
    for r in racers:
        final = r.codes[-1] if r.codes else None
        if r is winner and final != 0:
            problems.append(f"the winner {r.label} exited {final}: {r.output[-1][-400:]}")
        if winner is not None and r is not winner:
            if final != EXIT_FAILED:
                problems.append(f"the loser {r.label} exited {final}, not 1")
            elif "conflict" not in r.output[-1]:
                problems.append(f"the loser {r.label} did not say conflict: {r.output[-1][-400:]}")
    return RaceVerdict(winner.label if winner else None, problems, racers)


def _failure(output: str) -> str:
    """The last failure a racer's log says, for a problem's line."""
    for line in reversed(output.splitlines()):
        if '"checkpoint_failed"' in line or '"checkpoint_conflict"' in line or "ckptd:" in line:
            return line[-300:]
    return output[-300:]
