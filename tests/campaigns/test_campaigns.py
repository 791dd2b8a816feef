"""The short versions of the three campaigns, run by ``make test`` (marker ``campaign``;
``pytest -m 'not campaign'`` leaves them out). The long ones: ``python -m tests.campaigns``.

The seed is drawn per session and printed; ``CAMPAIGN_SEED=N`` repeats a run.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.campaigns.env import Stage, stage
from tests.campaigns.faults import FaultCampaign
from tests.campaigns.hostile import run_hostile
from tests.campaigns.kill import PHASES, KillCampaign

pytestmark = [pytest.mark.campaign, pytest.mark.timeout(600)]

# Not CKPTD_*: the daemon refuses an unknown CKPTD_ variable, and it inherits this one.
SEED = int(os.environ.get("CAMPAIGN_SEED") or random.SystemRandom().randrange(1 << 31))


@pytest.fixture
def campaign_stage(tmp_path: Path, local_s3: LocalS3) -> Iterator[Stage]:
    with stage(tmp_path, local_s3) as st:
        yield st


def _prefix(kind: str) -> str:
    return f"campaign-{kind}-{uuid.uuid4().hex[:8]}"


def test_kill_9_at_random_instants_loses_and_corrupts_nothing(campaign_stage: Stage) -> None:
    print(f"campaign seed {SEED} (CAMPAIGN_SEED={SEED} repeats it)")
    result = KillCampaign(
        campaign_stage, trials=2 * len(PHASES), seed=SEED, prefix=_prefix("kill")
    ).run()
    print(result.table())
    assert not result.problems, f"seed {SEED}:\n" + "\n".join(result.problems)
    landed = {t.phase for t in result.trials}
    # The kills did land where they were aimed (most of them): the campaign tests what
    # it says. Two phases may be missed by a short run's randomness, not more.
    assert len(landed & set(PHASES)) >= len(PHASES) - 2, landed


def test_proxy_faults_at_5_20_50_percent_commit_or_fail_clearly_never_corrupt(
    campaign_stage: Stage,
) -> None:
    print(f"campaign seed {SEED} (CAMPAIGN_SEED={SEED} repeats it)")
    result = FaultCampaign(
        campaign_stage, total_mib=30, seed=SEED, prefix=_prefix("faults"), deadline_s=240
    ).run()
    print(result.table())
    assert not result.problems, f"seed {SEED}:\n" + "\n".join(result.problems)
    # 5 % of ~50 requests injects nothing about one run in ten; 20 % and 50 % always do.
    assert all(r.faults > 0 for r in result.rates if r.rate >= 0.2)


def test_hostile_manifests_latest_and_metadata_never_crash_mislead_or_escape(
    campaign_stage: Stage,
) -> None:
    print(f"campaign seed {SEED} (CAMPAIGN_SEED={SEED} repeats it)")
    result = run_hostile(campaign_stage, examples=60, seed=SEED, prefix=_prefix("hostile"))
    print(result.table())
    assert not result.problems, f"seed {SEED}:\n" + "\n".join(result.problems)
    assert all(r.examples > 0 for r in result.rows)
