"""Campaign 2: the store misbehaves on a share of all requests; nothing corrupt commits.

For each fault rate (0 first: the fault-free reference, then 5 %, 20 %, 50 %) a fresh
daemon ships the same workload of HF-shaped checkpoints through the fault proxy, which
answers that share of requests (every method, drawn with the campaign's seed) with
a 500, a 503 SlowDown, a reset mid-body, a stall (``stall_seconds``, then a reset), or
a reset after the request took effect upstream (the client never learns it did).
Every checkpoint must end committed, or clearly failed (a ``checkpoint_failed`` log
line and ``ckptd_checkpoints_failed_total``) while the daemon keeps trying; the
independent checker then reads every committed byte back, and no multipart upload may
be left. The time to commit everything is set against the fault-free run's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ckptd.devtools.locals3 import free_port
from tests.campaigns.checker import tree_crcs
from tests.campaigns.env import BUCKET, MiB, Stage, table, write_daemon_config
from tests.support.daemon import Daemon
from tests.support.writers import write_hf

RATES = (0.0, 0.05, 0.2, 0.5)
KINDS = ("500", "503-slowdown", "reset", "timeout", "reset-after-upstream")
RUN = "run"


@dataclass
class RateResult:
    rate: float
    requests: int = 0
    faults: int = 0
    retries: int = 0
    checkpoints: int = 0
    committed: int = 0
    clearly_failed: int = 0  # not committed at the deadline, checkpoint_failed logged
    queued: int = 0  # not committed at the deadline, listed in /v1/status (waiting its turn)
    committed_after: int = 0  # committed once the faults stopped (before the daemon exited)
    failed_events: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass
class FaultResult:
    seed: int
    total_mib: int
    stall_seconds: float
    rates: list[RateResult]

    @property
    def problems(self) -> list[str]:
        return [f"rate {r.rate:.0%}: {p}" for r in self.rates for p in r.problems]

    def table(self) -> str:
        base = self.rates[0].seconds if self.rates and self.rates[0].rate == 0 else 0.0
        rows = [
            [
                f"{r.rate:.0%}",
                r.requests,
                r.faults,
                r.retries,
                r.checkpoints,
                r.committed,
                f"{r.clearly_failed} / {r.queued}",
                r.committed_after,
                r.failed_events,
                len(r.problems),
                f"{r.seconds:.1f}",
                f"{r.seconds / base:.1f}x" if base else "",
            ]
            for r in self.rates
        ]
        header = [
            "fault rate",
            "requests",
            "faults injected",
            "retries",
            "checkpoints",
            "committed",
            "not committed at the deadline: failed (logged) / queued (in status)",
            "committed once faults stopped",
            "checkpoint_failed lines",
            "problems (corrupt, silent, orphaned)",
            "s to commit all",
            "vs fault-free",
        ]
        return table(
            f"proxy fault campaign: {self.total_mib} MiB per rate, kinds {', '.join(KINDS)} "
            f"(stall {self.stall_seconds:g} s), seed {self.seed}; problems: {len(self.problems)}",
            header,
            rows,
        )


class FaultCampaign:
    def __init__(
        self,
        stage: Stage,
        *,
        total_mib: int,
        seed: int,
        prefix: str,
        rates: tuple[float, ...] = RATES,
        deadline_s: float = 900.0,
        say: Any = print,
    ) -> None:
        self.stage, self.total_mib, self.seed, self.prefix = stage, total_mib, seed, prefix
        self.rates, self.deadline_s, self.say = rates, deadline_s, say
        # Checkpoints of model + optimizer (half) + small files: 2 for a small run (so the
        # model goes in parts), else 4 or more so no single file exceeds 512 MiB.
        self.count = 2 if total_mib < 100 else max(4, total_mib // 768)
        self.model_bytes = max(MiB, int(total_mib * MiB / self.count / 1.5))
        self.part_mib = 5 if total_mib < 1024 else 16

    def run(self) -> FaultResult:
        self.say(
            f"fault campaign: seed {self.seed}, {self.count} checkpoints of "
            f"{1.5 * self.model_bytes / MiB:.0f} MiB per rate"
        )
        results = [self._one(rate) for rate in self.rates]
        return FaultResult(self.seed, self.total_mib, self.stage.proxy.stall_seconds, results)

    def _one(self, rate: float) -> RateResult:
        proxy = self.stage.proxy
        result = RateResult(rate, checkpoints=self.count)
        work = self.stage.work / "faults" / f"rate-{int(rate * 100):02d}"
        root = work / RUN
        root.mkdir(parents=True)
        prefix = f"{self.prefix}/rate-{int(rate * 100):02d}"
        names = [
            write_hf(root, step, model_bytes=self.model_bytes).name
            for step in range(1, self.count + 1)
        ]
        local = {name: tree_crcs(root / name) for name in names}
        checker = self.stage.checker(prefix)
        port = free_port()
        config = write_daemon_config(
            work / "daemon.toml",
            watch=root,
            dest=f"s3://{BUCKET}/{prefix}",
            endpoint_url=proxy.url,
            state_dir=work / "state",
            port=port,
            settle_seconds=0,
            keep_last=0,
            part_size_mib=self.part_mib,
            concurrency=4,
        )
        daemon = Daemon(config, work / "daemon.log", port, env=self.stage.daemon_env())
        requests, faults = len(proxy.requests), proxy.faults_injected
        proxy.set_faults(rate=rate, kinds=KINDS, seed=self.seed)
        started = time.monotonic()
        try:
            daemon.start()
            committed: set[str] = set()
            while time.monotonic() - started < self.deadline_s:
                committed = set(checker.committed_names(RUN)) & set(names)
                if len(committed) == len(names):
                    break
                time.sleep(0.2)
            result.seconds = time.monotonic() - started
            result.committed = len(committed)
            metrics = daemon.metrics()
            # What the daemon says of the rest: a checkpoint waiting its turn (ckptd ships
            # a run's newest first, one at a time) or retrying is in /v1/status.
            status = json.dumps(daemon.get_json("/v1/status")["runs"].get(RUN, {}))
            proxy.clear_faults()
            code = daemon.stop(timeout=180)
        finally:
            proxy.clear_faults()
            if daemon.alive():
                daemon.kill9()
        result.requests = len(proxy.requests) - requests
        result.faults = proxy.faults_injected - faults
        result.retries = int(sum(v for (n, _), v in metrics.items() if n == "ckptd_retries_total"))
        failed_metric = sum(
            v for (n, _), v in metrics.items() if n == "ckptd_checkpoints_failed_total"
        )
        failed_logged = {e.get("checkpoint") for e in daemon.events_named("checkpoint_failed")}
        result.failed_events = len(daemon.events_named("checkpoint_failed"))
        missing = [n for n in names if n not in committed]
        failed = [n for n in missing if n in failed_logged and failed_metric]
        queued = [n for n in missing if n not in failed and f'"{n}"' in status]
        result.clearly_failed, result.queued = len(failed), len(queued)
        silent = [n for n in missing if n not in failed and n not in queued]
        if silent:
            result.problems.append(f"not committed, not failed, not in /v1/status: {silent}")
        result.committed_after = len(set(checker.committed_names(RUN)) & set(missing))
        if code != 0:
            result.problems.append(f"daemon exited {code} on SIGTERM")
        verdict = checker.check_run(RUN, local)
        result.problems += verdict.problems
        orphans = checker.multipart_uploads()
        if orphans:
            result.problems.append(f"{len(orphans)} multipart uploads left")
        self.say(
            f"  rate {rate:4.0%}: {result.committed}/{result.checkpoints} committed in "
            f"{result.seconds:.1f} s, {result.faults} faults of {result.requests} requests, "
            f"{result.retries} retries{' PROBLEMS: ' + '; '.join(result.problems) if result.problems else ''}"
        )
        return result
