"""Campaign 1: ``kill -9`` of ``ckptd run`` (and of ``ckptd restore``) at random instants.

Each trial starts the daemon as a real process on one watch dir (state dir, journal and
store carried over from trial to trial, as on a node), saves the next HF-shaped
checkpoint (file sizes drawn so some go in one PUT and others in 3-5 parts of 5 MiB),
and kills the daemon at a seeded random instant inside the phase the trial aims at:

- scanning    while the trainer writes, or within the settle window after its last file
- uploading   a random point of the (throttled) transfer
- verifying   the store's checks (HEAD, CompleteMultipartUpload), held 0.4 s by the proxy
- committing  the manifest and LATEST writes, held 0.4 s by the proxy
- retention   the deletions of old checkpoints (``keep_last = 2``), held 0.4 s each
- restore     ``ckptd restore`` killed a random time into a full restore (GETs held)

The proxy's holds only widen a window; the kill instant inside it is random, and
where it really landed is read back from the killed daemon's own log lines and the
requests it made. After each kill a new daemon starts and finishes the work, then the
independent checker (``checker.py``) proves nothing committed is wrong or missing,
nothing is lost, no part journalled as done went over the wire again, and no
multipart upload is left behind. A killed restore leaves ``DIR/NAME`` absent or
complete, and a rerun completes it.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from ckptd.devtools.locals3 import free_port
from tests.campaigns.checker import check_restored, tree_crcs
from tests.campaigns.env import BUCKET, MiB, Stage, table, write_daemon_config
from tests.support.daemon import Daemon
from tests.support.faultproxy import RequestRecord
from tests.support.writers import hf_steps

PHASES = ("scanning", "uploading", "verifying", "committing", "retention", "restore")
RUN = "run"
HOLD = 0.4  # seconds the proxy holds each request of the aimed-at phase
KEEP_LAST = 2
SETTLE = 0.3  # the watch's settle_seconds


@dataclass
class Trial:
    target: str
    phase: str = ""
    outcome: str = ""
    parts_done: int = 0  # parts the journal held as finished at the kill
    parts_resent: int = 0  # of those, sent again after the restart
    problems: list[str] = field(default_factory=list)


@dataclass
class KillResult:
    seed: int
    trials: list[Trial]
    seconds: float

    @property
    def problems(self) -> list[str]:
        return [
            f"trial {i} ({t.phase}): {p}" for i, t in enumerate(self.trials) for p in t.problems
        ]

    def table(self) -> str:
        rows = []
        for phase in (*PHASES, "idle"):
            ts = [t for t in self.trials if t.phase == phase]
            if not ts:
                continue
            outcomes = Counter(t.outcome for t in ts)
            rows.append(
                [
                    phase,
                    len(ts),
                    "; ".join(f"{k} {v}" for k, v in sorted(outcomes.items())),
                    sum(t.parts_done for t in ts),
                    sum(t.parts_resent for t in ts),
                    sum(1 for t in ts if t.problems),
                ]
            )
        header = [
            "phase killed in",
            "trials",
            "outcome",
            "parts + objects journalled done at kill",
            "of those resent",
            "trials with a problem",
        ]
        return table(
            f"kill -9 campaign: {len(self.trials)} trials, seed {self.seed}, "
            f"{self.seconds:.0f} s; problems: {len(self.problems)}",
            header,
            rows,
        )


def _poll(predicate: Any, timeout: float) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _journal_done(state_dir: Path) -> tuple[set[tuple[str, int]], set[str]]:
    """(upload id, part number) of every part and key of every object the journal holds
    as finished; read after the kill, with sqlite's own recovery of the WAL."""
    db_path = state_dir / "journal.sqlite3"
    if not db_path.exists():
        return set(), set()
    with sqlite3.connect(db_path) as db:
        parts = {(u, int(n)) for u, n in db.execute("SELECT upload_id, number FROM parts")}
        objects = {k for (k,) in db.execute("SELECT key FROM objects")}
    return parts, objects


def _resent(records: list[RequestRecord], parts: set[tuple[str, int]], objects: set[str]) -> int:
    """How many of ``records`` send again a part or object the journal held as done."""
    n = 0
    for r in records:
        if r.method != "PUT":
            continue
        query = parse_qs(r.query)
        if "uploadId" in query and "partNumber" in query:
            if (query["uploadId"][0], int(query["partNumber"][0])) in parts:
                n += 1
        elif not r.query and unquote(r.path).removeprefix(f"/{BUCKET}/") in objects:
            n += 1
    return n


def _is_verify(method: str, query: str) -> bool:
    """The store's report on a file: CompleteMultipartUpload (its answer carries the
    checksum ckptd compares) or a HEAD."""
    return method == "HEAD" or (method == "POST" and "uploadId=" in query)


def in_flight(
    arrivals: list[tuple[str, str]], answered: list[RequestRecord]
) -> list[tuple[str, str]]:
    """The requests that had arrived but not been answered: (method, target)."""
    pending = Counter(arrivals)
    pending.subtract(
        Counter((r.method, f"{r.path}?{r.query}" if r.query else r.path) for r in answered)
    )
    return [a for a in arrivals if pending[a] > 0]


def classify(
    events: list[dict[str, Any]],
    arrivals: list[tuple[str, str]],
    unanswered: list[tuple[str, str]],
    name: str,
) -> str:
    """The phase a kill landed in, from the killed daemon's log lines about checkpoint
    ``name`` and the requests it had begun (``arrivals``, in order, as the proxy saw
    their heads; ``unanswered``, those it was still waiting on). Between
    ``checkpoint_uploading`` and ``checkpoint_verified``: waiting on a store's report
    (see ``_is_verify``) means verifying, else uploading. After ``checkpoint_verified``:
    a request after LATEST's write means retention (it runs before the commit is logged),
    else committing."""
    seen = [e["event"] for e in events if e.get("checkpoint") == name]
    if "checkpoint_committed" in seen or "checkpoint_already_committed" in seen:
        return "idle"
    if "checkpoint_verified" in seen:
        latest = [
            i for i, (m, t) in enumerate(arrivals) if m == "PUT" and t.endswith(f"/{RUN}/LATEST")
        ]
        return "retention" if latest and latest[-1] < len(arrivals) - 1 else "committing"
    if "checkpoint_uploading" in seen:
        mine = [
            (method, target.partition("?")[2])
            for method, target in unanswered
            if f"/{RUN}/{name}/" in unquote(target.partition("?")[0])
        ]
        return "verifying" if any(_is_verify(m, q) for m, q in mine) else "uploading"
    return "scanning"


class KillCampaign:
    def __init__(
        self,
        stage: Stage,
        *,
        trials: int,
        seed: int,
        prefix: str,
        sizes_mib: tuple[int, ...] = (3, 12, 23),
        upload_mib_per_s: float = 25.0,
        say: Any = print,
    ) -> None:
        self.stage, self.trials, self.seed, self.prefix = stage, trials, seed, prefix
        self.sizes_mib, self.rate, self.say = sizes_mib, upload_mib_per_s, say
        self.rng = random.Random(seed)
        self.work = stage.work / "kill"
        self.root = self.work / RUN
        self.state = self.work / "state"
        self.root.mkdir(parents=True, exist_ok=True)
        self.checker = stage.checker(prefix)
        self.local: dict[str, dict[str, tuple[int, str]]] = {}  # name -> path -> (size, crc)
        self.step = 0
        self.restore_seconds = 0.0

    def run(self) -> KillResult:
        self.say(f"kill campaign: seed {self.seed}, {self.trials} trials")
        started = time.monotonic()
        done: list[Trial] = []
        for i in range(self.trials):
            target = PHASES[i % len(PHASES)]
            trial = self._restore_trial(i) if target == "restore" else self._daemon_trial(i, target)
            done.append(trial)
            self.say(
                f"  trial {i:3d} aimed at {target:<10} landed in {trial.phase:<10} "
                f"{trial.outcome}{' PROBLEMS: ' + '; '.join(trial.problems) if trial.problems else ''}"
            )
        return KillResult(self.seed, done, time.monotonic() - started)

    # -- the daemon ------------------------------------------------------------------------

    def _daemon(self, label: str) -> Daemon:
        port = free_port()
        config = write_daemon_config(
            self.work / f"{label}.toml",
            watch=self.root,
            dest=f"s3://{BUCKET}/{self.prefix}",
            endpoint_url=self.stage.proxy.url,
            state_dir=self.state,
            port=port,
            keep_last=KEEP_LAST,
            settle_seconds=SETTLE,
            part_size_mib=5,
            concurrency=2,
            max_upload_mib_per_s=self.rate,
        )
        return Daemon(config, self.work / f"{label}.log", port, env=self.stage.daemon_env())

    def _arm(self, target: str, name: str) -> None:
        under = f"/{BUCKET}/{self.prefix}/{RUN}/"
        mine = f"{under}{name}/"
        if target == "verifying":
            self.stage.proxy.hold(
                HOLD,
                lambda m, p, q: (
                    unquote(p).startswith(mine)
                    and (m == "HEAD" or (m == "POST" and "uploadId=" in q))
                ),
            )
        elif target == "committing":
            self.stage.proxy.hold(
                HOLD,
                lambda m, p, q: (
                    m == "PUT" and (p.endswith("/ckptd.manifest.json") or p == f"{under}LATEST")
                ),
            )
        elif target == "retention":
            self.stage.proxy.hold(
                HOLD,
                # DeleteObjects is a POST to the bucket itself.
                lambda m, p, q: (
                    (m == "DELETE" and unquote(p).startswith(under))
                    or (m == "POST" and "delete" in q)
                ),
            )

    def _daemon_trial(self, i: int, target: str) -> Trial:
        trial = Trial(target)
        proxy = self.stage.proxy
        self.step += 1
        name = f"checkpoint-{self.step}"
        # Verifying is the store's report on CompleteMultipartUpload (or a HEAD), so a
        # trial aimed at it ships files in parts; it waits for the last file's report.
        sizes = [s for s in self.sizes_mib if s > 8] if target == "verifying" else self.sizes_mib
        size = self.rng.choice(sizes or self.sizes_mib) * MiB
        verifies = sum(1 for b in (size, size // 2) if b > 8 * MiB)
        first, first_answered = len(proxy.arrivals), len(proxy.requests)
        held = proxy.held
        killed = self._daemon(f"{i:03d}-killed").start()
        try:
            self._arm(target, name)
            writer = hf_steps(self.root, self.step, model_bytes=size)
            if target == "scanning":
                steps = self.rng.randint(1, 3)
                for _ in range(steps):
                    next(writer)
                time.sleep(self.rng.uniform(0, SETTLE) if steps == 3 else self.rng.uniform(0, 0.1))
            else:
                for _ in writer:
                    pass
                if target == "uploading":
                    sent = proxy.bytes_up_by("PUT")
                    _poll(lambda: proxy.bytes_up_by("PUT") > sent, 60)
                    time.sleep(self.rng.uniform(0, 0.7 * 1.5 * size / (self.rate * MiB)))
                else:
                    wanted = held + (verifies if target == "verifying" else 1)
                    _poll(lambda: proxy.held >= wanted, 60)  # else: killed where it is
                    time.sleep(self.rng.uniform(0, 1.5 * HOLD))
            killed.kill9()
        finally:
            if killed.alive():
                killed.kill9()
        at_kill, answered = len(proxy.arrivals), proxy.requests[first_answered:]
        proxy.hold(0)
        for _ in writer:  # the trainer carries on saving: only the daemon died
            pass
        committed_at_kill = self.checker.manifest(RUN, name) is not None
        parts, objects = _journal_done(self.state)
        arrivals = proxy.arrivals[first:at_kill]
        trial.phase = classify(killed.events(), arrivals, in_flight(arrivals, answered), name)
        self.local[name] = tree_crcs(self.root / name)

        restart = len(proxy.requests)
        with self._daemon(f"{i:03d}-restarted") as again:
            if not _poll(lambda: self._committed_and_latest(name), 120):
                trial.problems.append(f"{name} not committed with LATEST on it 120 s after restart")
            code = again.stop()
        if code != 0:
            trial.problems.append(f"restarted daemon exited {code} on SIGTERM")
        trial.parts_done = len(parts) + len(objects)
        trial.parts_resent = _resent(proxy.requests[restart:], parts, objects)
        if trial.parts_resent:
            trial.problems.append(f"{trial.parts_resent} finished parts or objects sent again")
        trial.outcome = (
            "committed before the kill"
            if committed_at_kill
            else ("resumed, committed" if parts or objects else "committed after restart")
        )
        self._judge(trial)
        return trial

    def _committed_and_latest(self, name: str) -> bool:
        if self.checker.manifest(RUN, name) is None:
            return False
        latest = self.checker.get(f"{self.prefix}/{RUN}/LATEST")
        return latest is not None and json.loads(latest).get("checkpoint") == name

    def _judge(self, trial: Trial) -> None:
        verdict = self.checker.check_run(RUN, self.local)
        trial.problems += verdict.problems
        newest = sorted(self.local, key=lambda n: int(n.rsplit("-", 1)[1]))[-KEEP_LAST:]
        lost = [n for n in newest if n not in verdict.committed]
        if lost:
            trial.problems.append(f"lost (not committed, retention not entitled): {lost}")
        if verdict.latest is None or verdict.latest.get("checkpoint") != newest[-1]:
            trial.problems.append(f"LATEST is {verdict.latest}, not {newest[-1]}")
        orphans = self.checker.multipart_uploads()
        if orphans:
            trial.problems.append(f"{len(orphans)} multipart uploads left: {orphans[:2]}")

    # -- restore ---------------------------------------------------------------------------

    def _restore(self, name: str, to: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "ckptd",
            "restore",
            "--dest",
            f"s3://{BUCKET}/{self.prefix}",
            "--endpoint-url",
            self.stage.proxy.url,
            "--run",
            RUN,
            "--checkpoint",
            name,
            "--to",
            str(to),
            "--no-progress",
            *extra,
            "--chunk-mib",
            "1",
            "--concurrency",
            "2",
        ]
        with open(log, "ab") as out:
            return subprocess.Popen(
                cmd,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.stage.daemon_env()},
            )

    def _first_get(self, name: str) -> float:
        """When the first ranged GET of one of ``name``'s files arrives at the proxy (polled
        from now; 60 s at most): the download has begun, the staging dir exists."""
        seen = len(self.stage.proxy.arrivals)
        _poll(
            lambda: any(
                m == "GET" and f"/{RUN}/{name}/" in t and "ckptd.manifest.json" not in t
                for m, t in self.stage.proxy.arrivals[seen:]
            ),
            60,
        )
        return time.monotonic()

    def _restore_trial(self, i: int) -> Trial:
        trial = Trial("restore", phase="restore")
        names = sorted(self.checker.committed_names(RUN), key=lambda n: int(n.rsplit("-", 1)[1]))
        if not names:
            trial.outcome = "nothing committed to restore"
            trial.problems.append("no committed checkpoint to restore")
            return trial
        name = self.rng.choice(names)
        manifest = self.checker.manifest(RUN, name)
        assert manifest is not None
        to = self.work / "restores" / f"{i:03d}"
        to.mkdir(parents=True)
        log = self.work / f"{i:03d}-restore.log"
        # GETs held a little so a full restore lasts long enough to be cut anywhere.
        self.stage.proxy.hold(0.05, lambda m, p, q: m == "GET" and f"/{RUN}/{name}/" in p)
        try:
            if not self.restore_seconds:  # calibrate once: how long the restore's work takes
                scratch = self.work / "restores" / "calibration"
                scratch.mkdir(parents=True, exist_ok=True)
                calibration = self._restore(name, scratch, log)
                begun = self._first_get(name)
                calibration.wait(timeout=300)
                self.restore_seconds = time.monotonic() - begun
            proc = self._restore(name, to, log)
            # A random instant of its download, from the first file GET to its end.
            self._first_get(name)
            time.sleep(self.rng.uniform(0, self.restore_seconds))
            finished = proc.poll() is not None
            if not finished:
                proc.kill()
            proc.wait()
        finally:
            self.stage.proxy.hold(0)
        target = to / name
        # Whether it had begun: the staging dir (and its files) exist from the first GET.
        staged = sum(1 for _ in (to / f".ckptd-restore-{name}").rglob("*"))
        if not target.exists():
            state = f"absent, {'staging begun' if staged else 'nothing staged'}"
        elif check_restored(target, manifest):
            state = "PARTIAL"
            trial.problems += check_restored(target, manifest)
        else:
            state = "complete"
        rerun = self._restore(name, to, log, "--if-missing")
        code = rerun.wait(timeout=300)
        if code != 0:
            trial.problems.append(f"restore rerun exited {code}")
        trial.problems += (
            check_restored(target, manifest) if target.exists() else ["rerun left nothing"]
        )
        # Beside it only the record a restore leaves of what it wrote (.ckptd/restored.json).
        leftovers = sorted(p.name for p in to.iterdir() if p.name not in (name, ".ckptd"))
        if leftovers:
            trial.problems.append(f"left beside DIR/NAME after the rerun: {leftovers}")
        trial.outcome = (
            f"finished before the kill, {state}"
            if finished
            else f"killed: target {state}; rerun ok"
        )
        if trial.problems:
            trial.outcome = trial.outcome.replace("; rerun ok", "")
        return trial
