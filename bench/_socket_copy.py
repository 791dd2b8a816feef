"""Reference: the bytes of a directory over one TCP connection on 127.0.0.1, no protocol.

    python bench/_socket_copy.py DIR

The sender streams each file with ``socket.sendfile`` (the kernel copies from the page
cache, no user-space buffer); a receiver child process reads into one reused buffer and
drops the bytes. Both run under this process, so a ``_measure.py`` wrapper counts the CPU
of sender and receiver together. This is the ceiling of any loopback upload on this
machine: no HTTP, no checksum, no server storing anything.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

BUF = 1024 * 1024


def receive() -> int:
    """Child side: accept one connection, count the bytes, print the count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            buf = bytearray(BUF)
            view = memoryview(buf)
            total = 0
            while n := conn.recv_into(view):
                total += n
    print(total, flush=True)
    return 0


def send(root: Path) -> int:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    expected = sum(p.stat().st_size for p in files)
    child = subprocess.Popen(
        [sys.executable, __file__, "--receive"], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    port = int(child.stdout.readline())
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for p in files:
            with p.open("rb") as f:
                sock.sendfile(f)
    received = int(child.stdout.readline())
    child.wait()
    if received != expected:
        print(f"received {received} bytes, sent {expected}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("dir", type=Path, nargs="?")
    args = parser.parse_args(argv)
    if args.receive:
        return receive()
    if args.dir is None:
        parser.error("DIR is required")
    return send(args.dir)


if __name__ == "__main__":
    raise SystemExit(main())
