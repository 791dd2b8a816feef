"""A stand-in trainer for ``bench_preemption.py``: records when each signal arrives.

    python bench/_signal_receiver.py --pidfile PID --record FILE [--signal SIGUSR1]
        [--notice-file WATCH/.ckptd/preemption.json]

Installs its handler first, then writes ``PID`` (by rename, so the daemon never reads a
half-written file), then sleeps in ``signal.pause()``. Each signal appends one line to
``FILE``: ``CLOCK_MONOTONIC`` in nanoseconds at arrival. On Linux that clock is one per
boot, shared by every process on the machine, so the benchmark compares it with its own
``time.monotonic_ns()`` at the moment it triggered the notice. Then, on the same line, the
wall clock, and with ``--notice-file`` that file's mtime and ctime (ns; 0 if absent): the
daemon writes it to a temporary name (mtime) and renames it into place (ctime) before it
signals, so they split the daemon's notice -> signal time. Ends on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pidfile", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--signal", default="SIGUSR1")
    parser.add_argument("--notice-file", type=Path, default=None)
    options = parser.parse_args()
    signum = signal.Signals[options.signal]
    record = options.record.open("a", buffering=1)

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        # The clock is read first thing; the write may take longer, it is not timed.
        arrived = time.monotonic_ns()
        wall = time.time_ns()
        mtime = ctime = 0
        if options.notice_file is not None:
            try:
                st = os.stat(options.notice_file)
                mtime, ctime = st.st_mtime_ns, st.st_ctime_ns
            except OSError:
                pass
        record.write(f"{arrived} {wall} {mtime} {ctime}\n")
        record.flush()

    signal.signal(signum, on_signal)  # before the pidfile: the daemon may signal from then on
    tmp = options.pidfile.with_name(f".{options.pidfile.name}.tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, options.pidfile)
    while True:
        signal.pause()  # returns after each handled signal; SIGTERM's default action ends us


if __name__ == "__main__":
    sys.exit(main())
