"""``python -m tests.campaigns {kill,faults,hostile,races,all} [options]``: the long versions.

Each campaign starts its own SeaweedFS under ``--work`` (a temporary dir by default),
prints every trial and then its table, and exits 1 if any trial found a problem.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.campaigns.env import machine, stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.campaigns", description=__doc__)
    parser.add_argument("campaign", choices=("kill", "faults", "hostile", "races", "all"))
    parser.add_argument("--seed", type=int, default=None, help="default: random, printed")
    parser.add_argument("--trials", type=int, default=60, help="kill: trials (default 60)")
    parser.add_argument(
        "--fault-mib", type=int, default=2048, help="faults: MiB shipped per rate (default 2048)"
    )
    parser.add_argument(
        "--stall-seconds",
        type=float,
        default=65.0,
        help="faults: how long a stalled request hangs (default 65, past the 60 s read timeout)",
    )
    parser.add_argument(
        "--examples", type=int, default=2000, help="hostile: examples per property (default 2000)"
    )
    parser.add_argument("--races", type=int, default=20, help="races: races per store (default 20)")
    parser.add_argument(
        "--work", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"seed {seed}; {machine()}", flush=True)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    work = args.work or Path(tempfile.mkdtemp(prefix="ckptd-campaign-"))
    problems: list[str] = []
    tables: list[str] = []
    with stage(work) as st:
        os.environ.update(st.s3.env())
        prefix = f"campaign-{uuid.uuid4().hex[:8]}"
        if args.campaign in ("kill", "all"):
            from tests.campaigns.kill import KillCampaign

            result = KillCampaign(st, trials=args.trials, seed=seed, prefix=f"{prefix}-kill").run()
            problems += result.problems
            tables.append(result.table())
        if args.campaign in ("faults", "all"):
            from tests.campaigns.faults import FaultCampaign

            st.proxy.stall_seconds = args.stall_seconds
            faults = FaultCampaign(
                st, total_mib=args.fault_mib, seed=seed, prefix=f"{prefix}-faults"
            ).run()
            problems += faults.problems
            tables.append(faults.table())
        if args.campaign in ("hostile", "all"):
            from tests.campaigns.hostile import run_hostile

            hostile = run_hostile(st, examples=args.examples, seed=seed, prefix=f"{prefix}-hostile")
            problems += hostile.problems
            tables.append(hostile.table())
        if args.campaign in ("races", "all"):
            from tests.campaigns.races import RaceCampaign

            races = RaceCampaign(st, races=args.races, seed=seed).run()
            problems += races.problems
            tables.append(races.table())
    print("\n".join(tables), flush=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; work dir {work}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
