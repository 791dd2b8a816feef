"""The race campaign: many races of two ``ckptd run --once`` on one checkpoint name, on
every store found here (``tests/support/races.py``), half of them with one racer killed
with ``kill -9`` at a seeded instant and restarted. Every race must end with exactly one
writer's bytes committed (read back from the store), the winner exiting 0 and the loser 1
saying conflict.

    python -m tests.campaigns races [--races 20] [--seed N]
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.campaigns.env import Stage
from tests.support.emulators import Azurite, FakeGCS, azurite_binary, fake_gcs_binary
from tests.support.races import run_race


@dataclass
class RaceCampaign:
    stage: Stage
    races: int
    seed: int
    problems: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)

    def run(self) -> RaceCampaign:
        rng = random.Random(self.seed)
        work = self.stage.work / "races"
        work.mkdir(parents=True, exist_ok=True)
        stores: list[tuple[str, str, str]] = [
            (
                "s3 (SeaweedFS)",
                f"s3://ckpt/races-{uuid.uuid4().hex[:8]}",
                self.stage.s3.endpoint_url,
            ),
            ("file://", f"file://{work / 'file-store'}", ""),
        ]
        servers: list[FakeGCS | Azurite] = []
        gcs, azurite = fake_gcs_binary(), azurite_binary()
        if gcs is not None:
            servers.append(FakeGCS(gcs, work / "fake-gcs.log").start())
            stores.append(
                (
                    "gs:// (fake-gcs-server)",
                    f"gs://ckpt/races-{uuid.uuid4().hex[:8]}",
                    servers[-1].endpoint_url,
                )
            )
        else:
            self.rows.append("| gs:// | skipped: fake-gcs-server not found | | | | |")
        if azurite is not None:
            (work / "azurite").mkdir(exist_ok=True)
            servers.append(Azurite(azurite, work / "azurite").start())
            stores.append(
                (
                    "az:// (Azurite)",
                    f"az://ckpt/races-{uuid.uuid4().hex[:8]}",
                    servers[-1].endpoint_url,
                )
            )
        else:
            self.rows.append("| az:// | skipped: Azurite not found | | | | |")
        try:
            for label, dest, endpoint in stores:
                self._store(work, label, dest, endpoint, rng)
        finally:
            for server in servers:
                server.stop()
        return self

    def _store(self, work: Path, label: str, dest: str, endpoint: str, rng: random.Random) -> None:
        winners: Counter[str] = Counter()
        kills = failed = retried = 0
        for n in range(self.races):
            kill = n % 2 == 1
            base = dest.rstrip("/") + f"/race-{n}"
            verdict = run_race(
                work / label.split()[0].strip(":/") / f"race-{n}", base, endpoint, rng, kill=kill
            )
            print(f"{label} race {n}: {verdict.describe()} {verdict.problems or 'ok'}", flush=True)
            kills += sum(1 for r in verdict.racers if r.killed_at is not None)
            retried += sum(r.retried for r in verdict.racers)
            winners[verdict.winner or "none"] += 1
            if verdict.problems:
                failed += 1
                self.problems += [f"{label} race {n}: {p}" for p in verdict.problems]
        self.rows.append(
            f"| {label} | {self.races} | {kills} | {retried} | {dict(sorted(winners.items()))} "
            f"| {failed} |"
        )

    def table(self) -> str:
        head = [
            f"\n## Races: two writers, one name (seed {self.seed})\n",
            "| store | races | racers killed (-9) and restarted | runs again after a store "
            "failure | winners | races with a problem |",
            "| --- | ---: | ---: | ---: | --- | ---: |",
        ]
        return "\n".join(head + self.rows)
