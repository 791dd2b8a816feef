"""A launcher shaped like torchrun: it handles SIGTERM but not SIGUSR1, and runs two
"ranks" that install a SIGUSR1 handler (as ``ckptd.trainer``'s listener does), mark
themselves ready, record the signal when it comes and exit 0. Exits with the ranks'
worst code.

    python -m tests.support.trainers.launcher_like DIR          # the launcher
    python -m tests.support.trainers.launcher_like DIR --rank I  # one rank (started by it)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def rank(out: Path) -> None:
    signal.signal(signal.SIGUSR1, lambda *_: out.write_text("SIGUSR1"))
    out.with_name(out.name + ".ready").write_text("")
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    directory = Path(sys.argv[1])
    if "--rank" in sys.argv:
        rank(directory / f"rank{sys.argv[sys.argv.index('--rank') + 1]}")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    me = [sys.executable, "-m", "tests.support.trainers.launcher_like", str(directory)]
    ranks = [subprocess.Popen([*me, "--rank", str(i)]) for i in (0, 1)]
    sys.exit(max(r.wait() for r in ranks))


if __name__ == "__main__":
    main()
