"""A stand-in trainer that only records the signals it gets: ``<signal number> <unix time>``
per line in ``--record``. Its pidfile is written after the handler is in place, so a
daemon that finds it can never kill it with the signal."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from types import FrameType


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pidfile", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    options = parser.parse_args()

    def record(signum: int, frame: FrameType | None) -> None:
        with options.record.open("a") as out:
            out.write(f"{signum} {time.time():.6f}\n")

    signal.signal(signal.SIGUSR1, record)
    options.pidfile.write_text(str(os.getpid()))
    ends = time.monotonic() + options.max_seconds
    while time.monotonic() < ends:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
