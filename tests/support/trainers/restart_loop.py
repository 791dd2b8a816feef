"""A plain supervisor loop, as a pod's or a unit's own restart would be, for the tests of the
daemon beside the trainer (``ckptd run``, no ``ckptd exec``)::

    python -m tests.support.trainers.restart_loop WATCH_DIR -- TRAINER_CMD...

Runs the trainer command; whenever it exits non-zero (``kill -9`` included) runs it again
at once, resuming from the newest checkpoint in the watch dir (``--resume
WATCH_DIR/step-N``, the highest N); stops when it exits 0, or after 10 runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

MAX_RUNS = 10


def newest_checkpoint(watch: Path) -> Path | None:
    steps = [
        (int(m.group(1)), p)
        for p in watch.glob("step-*")
        if (m := re.fullmatch(r"step-(\d+)", p.name)) and p.is_dir()
    ]
    return max(steps)[1] if steps else None


def main() -> int:
    watch, command = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1 :]
    for _ in range(MAX_RUNS):
        newest = newest_checkpoint(watch)
        code = subprocess.call([*command, *(["--resume", str(newest)] if newest else [])])
        if code == 0:
            return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
