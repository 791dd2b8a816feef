"""One TCP flow between two rig hosts, to measure a link: ``sink`` and ``send``.

    python -m tests.support.netflow sink ADDRESS PORT          prints "ready", then
                                                               drains each connection
    python -m tests.support.netflow send ADDRESS PORT MIB      sends MIB MiB, prints Mbit/s
    python -m tests.support.netflow pace ADDRESS PORT SECONDS [MBIT]
                                                               sends for SECONDS (at most
                                                               MBIT), prints Mbit/s

``send`` times from the first byte to the sink's one-byte answer after the last, so the
figure is what arrived, not what the kernel buffered. Run each inside a host
(``Host.argv``); used by ``tests.support.netns.Rig.measure`` and bench/bench_peers.py.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

CHUNK = 256 * 1024


def sink(address: str, port: int) -> None:
    server = socket.create_server((address, port), reuse_port=False)
    print("ready", flush=True)

    def drain(conn: socket.socket) -> None:
        with conn:
            buf = bytearray(CHUNK)
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    return
                if buf[n - 1 : n] == b"\x01":  # the sender's last byte: answer it
                    conn.sendall(b"k")

    while True:
        conn, _ = server.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def send(address: str, port: int, mib: int) -> float:
    data = b"\0" * CHUNK
    total = mib * 1024 * 1024
    with socket.create_connection((address, port), timeout=3) as conn:
        conn.settimeout(120)
        started = time.monotonic()
        sent = 0
        while sent + CHUNK < total:
            conn.sendall(data)
            sent += CHUNK
        conn.sendall(b"\0" * (total - sent - 1) + b"\x01")
        conn.recv(1)
        seconds = time.monotonic() - started
    return total * 8 / seconds / 1e6


def pace(address: str, port: int, seconds: float, mbit: float | None) -> float:
    """Send for ``seconds`` (at most ``mbit``); the rate that arrived."""
    data = b"\0" * CHUNK
    with socket.create_connection((address, port), timeout=120) as conn:
        started = time.monotonic()
        sent = 0
        while (now := time.monotonic()) - started < seconds:
            if mbit and sent * 8 / 1e6 > mbit * (now - started):
                time.sleep(0.002)
                continue
            conn.sendall(data)
            sent += CHUNK
        conn.sendall(b"\x01")
        conn.recv(1)
        elapsed = time.monotonic() - started
    return (sent + 1) * 8 / elapsed / 1e6


def main(argv: list[str]) -> int:
    mode, address, port = argv[0], argv[1], int(argv[2])
    if mode == "sink":
        sink(address, port)
    elif mode == "send":
        print(f"{send(address, port, int(argv[3])):.1f}")
    elif mode == "pace":
        mbit = float(argv[4]) if len(argv) > 4 else None
        print(f"{pace(address, port, float(argv[3]), mbit):.1f}")
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
