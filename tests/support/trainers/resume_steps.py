"""A trainer as the resume drill starts it (``ckptd drill --restore-only --resume-steps N
-- CMD``): it resumes from ``CKPTD_RESUME_FROM`` (the step its ``COMPLETE`` marker names),
reports each step with ``ckptd.trainer.report_step`` (into ``CKPTD_WATCH_DIR``), and stops
after ``CKPTD_DRILL_RESUME_STEPS`` steps, as a user's trainer honouring the drill would.

``--fail-after K`` exits 3 after K steps (a trainer that crashes once resumed);
``--ignore-steps`` keeps training past them (the drill must stop it); ``--report FILE``
notes the step it resumed from and where it stopped."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import ckptd.trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-after", type=int, default=None)
    parser.add_argument("--ignore-steps", action="store_true")
    parser.add_argument("--report", type=Path, default=None)
    options = parser.parse_args()
    checkpoint = Path(os.environ["CKPTD_RESUME_FROM"])
    step = int((checkpoint / "COMPLETE").read_text())  # what it resumed from
    first = step
    wanted = int(os.environ.get("CKPTD_DRILL_RESUME_STEPS", "0"))
    while options.ignore_steps or not wanted or step - first < wanted:
        time.sleep(0.05)  # one training step
        step += 1
        ckptd.trainer.report_step(step)
        if options.report is not None:
            options.report.write_text(f"{first} {step}")
        if options.fail_after is not None and step - first >= options.fail_after:
            print(f"loss is nan at step {step}", flush=True)
            sys.exit(3)


if __name__ == "__main__":
    main()
