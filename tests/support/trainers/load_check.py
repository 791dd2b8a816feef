"""The drill's load check as a user writes one: the trainer's own load function on the
restored checkpoint (its path is the last argument, and ``CKPTD_RESUME_FROM``); exit 0
when it loads and holds the step its marker names. ``--report FILE`` notes what it
loaded, for the test to compare."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tests.support.trainers.tiny_torch import load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("checkpoint", type=Path)
    options = parser.parse_args()
    if os.environ.get("CKPTD_RESUME_FROM") != str(options.checkpoint):
        sys.exit("CKPTD_RESUME_FROM is not the checkpoint given")
    step = load(options.checkpoint)
    marked = int((options.checkpoint / "COMPLETE").read_text())
    if step != marked:
        sys.exit(f"loaded step {step}, the checkpoint's marker says {marked}")
    options.report.write_text(f"{step} {options.checkpoint}")


if __name__ == "__main__":
    main()
