"""Run one command and report its wall time and the resources of its whole process tree.

    python bench/_measure.py [--stdout FILE] [--stderr FILE] -- CMD [ARG...]

Prints one JSON object on stdout: ``rc``, ``wall_s``, ``user_s``, ``sys_s``,
``maxrss_kib``, ``start_unix`` and ``end_unix``.

Why a separate process: ``getrusage(RUSAGE_CHILDREN)`` accumulates CPU over every child
a process has reaped, and its ``ru_maxrss`` is the maximum over all of them so far. Here
the measured command is this process's only child, so CPU is exactly that command's tree
(every descendant that its parents waited for, which is all of them for the tools
measured) and peak RSS is the largest single process in that tree during this run only.
Wall time starts just before the fork and ends when the child is reaped, so this
script's own start-up is not counted.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import IO


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdout", default=None, help="file for the command's stdout")
    parser.add_argument("--stderr", default=None, help="file for the command's stderr")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    args = parser.parse_args(argv)
    cmd: list[str] = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given (put it after --)")

    with ExitStack() as stack:
        out: IO[bytes] | int = subprocess.DEVNULL
        err: IO[bytes] | int = subprocess.DEVNULL
        if args.stdout:
            out = stack.enter_context(open(args.stdout, "wb"))
        if args.stderr:
            err = stack.enter_context(open(args.stderr, "wb"))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start_unix = time.time()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        rc = proc.wait()
        wall = time.perf_counter() - start
        end_unix = time.time()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)

    json.dump(
        {
            "rc": rc,
            "wall_s": wall,
            "user_s": after.ru_utime - before.ru_utime,
            "sys_s": after.ru_stime - before.ru_stime,
            # Linux reports ru_maxrss in KiB.
            "maxrss_kib": after.ru_maxrss,
            "start_unix": start_unix,
            "end_unix": end_unix,
        },
        sys.stdout,
    )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
