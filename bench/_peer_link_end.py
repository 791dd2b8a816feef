"""One end of ``bench_peer_link.py``'s runs, in a process of its own (so each end's CPU is
its own, from ``getrusage`` around the work; start-up is not counted).

    _peer_link_end.py bare-recv HOST PORT DIR     accept streams; write + fsync each; ack
                                                  (the last file kept until ``free``)
    _peer_link_end.py bare-send HOST PORT FILE..  sendfile FILEs, wait for the ack
    _peer_link_end.py hold HOST PORT DIR QUOTA    a peer port (PeerServer) over DIR
    _peer_link_end.py push ADDRESS STREAMS FILE.. push FILEs as one part (STREAMS 0: HTTP)
    _peer_link_end.py read ADDRESS MODE LANES DIR HID SIZE..  read a holding's files over
                                                  MODE (stream, http) in LANES ranges at
                                                  once, CRC-32C each, pwrite + fsync in DIR

The long-lived ends (``bare-recv``, ``hold``) print ``ready PORT`` and then answer each
line on stdin ``cpu`` with their CPU seconds so far; ``bare-recv`` prints one JSON line per
stream received. The one-shot ends print one JSON line: ``seconds``, ``cpu``.

Every end that writes through the page cache (the bare receiver, the reader) deletes its
previous output just before it receives again, outside the measured time (``free`` on the
bare receiver's stdin; the reader itself before its clock starts). So each writes into
pages just freed, as on a machine whose free memory stays its own. Here it does not: the
VM reports freed memory to its host within seconds, and a writer that gets such pages
pays a fault in the host for each, up to 2-3 CPU-s per GiB. Before, the bare receiver
kept two files and freed one after each stream while the reader freed its files at once,
so the order of the paths decided who paid for which pages.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import struct
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUF = 1024 * 1024
MIB = 1024 * 1024
TOKEN = b"bench-peer-link-token-0123456789abcdef"


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def answer_cpu_on_stdin(kept: list[Path] | None = None) -> None:
    for line in sys.stdin:
        if line.strip() == "cpu":
            print(json.dumps({"cpu": cpu()}), flush=True)
        elif line.strip() == "free":
            for path in kept or []:
                path.unlink(missing_ok=True)
            print(json.dumps({"freed": True}), flush=True)
    os._exit(0)  # stdin closed: the bench is done with this end


def bare_recv(host: str, port: int, out: Path) -> None:
    server = socket.create_server((host, port))
    print(f"ready {server.getsockname()[1]}", flush=True)
    kept: list[Path] = []
    threading.Thread(target=answer_cpu_on_stdin, args=(kept,), daemon=True).start()
    view = memoryview(bytearray(BUF))
    n = 0
    while True:
        conn, _ = server.accept()
        with conn:
            total = struct.unpack(">Q", conn.recv(8, socket.MSG_WAITALL))[0]
            path = out / f"bare-{n}"
            n += 1
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            got = 0
            while got < total:
                k = conn.recv_into(view, min(BUF, total - got))
                if k == 0:
                    break
                mv = view[:k]
                while mv:
                    mv = mv[os.write(fd, mv) :]
                got += k
            os.fsync(fd)
            os.close(fd)
            conn.sendall(b"k")
            kept.append(path)  # until the bench says ``free`` (module doc)


def bare_send(host: str, port: int, files: list[str]) -> None:
    started_cpu, started = cpu(), time.monotonic()
    sizes = [os.stat(f).st_size for f in files]
    with socket.create_connection((host, port)) as sock:
        sock.sendall(struct.pack(">Q", sum(sizes)))
        for f in files:
            with open(f, "rb") as fh:
                sock.sendfile(fh)
        if sock.recv(1) != b"k":
            raise SystemExit("no acknowledgement")
    print(json.dumps({"seconds": time.monotonic() - started, "cpu": cpu() - started_cpu}))


async def hold(host: str, port: int, root: Path, quota: int) -> None:
    from ckptd.peers.own import OwnParts
    from ckptd.peers.replicas import ReplicaStore
    from ckptd.peers.server import PeerServer
    from ckptd.runtime.clock import SYSTEM_CLOCK
    from ckptd.runtime.logs import get_logger
    from ckptd.runtime.metrics import Metrics

    log = get_logger()
    store = ReplicaStore(root, quota, log)  # the oldest replicas make room
    store.open()
    server = PeerServer(
        store,
        OwnParts(),
        TOKEN,
        Metrics(),
        SYSTEM_CLOCK,
        log,
        hello=lambda: {"peer": "holder", "incarnation": "x", "notice": False},
    )
    bound = await server.start(host, port)
    print(f"ready {bound}", flush=True)
    threading.Thread(target=answer_cpu_on_stdin, daemon=True).start()
    await asyncio.Event().wait()


async def push(address: str, streams: int, files: list[str]) -> None:
    from ckptd.peers.client import LocalFile, PeerClient
    from ckptd.peers.model import Replica
    from ckptd.peers.pacing import Pace
    from ckptd.runtime.clock import SYSTEM_CLOCK

    local = []
    for f in files:
        st = os.stat(f)
        local.append(LocalFile(Path(f).name, Path(f), st.st_size, st.st_mtime_ns))
    header = Replica.model_validate(
        {
            "run_id": "run",
            "checkpoint": "step-10",
            "name": "step-10",
            "save": "0a1b2c3d",
            "node_rank": 0,
            "nodes": 2,
            "step": 10,
            "layout": "dcp",
            "writer": "cluster-2",
            "host": "bench",
            "peer": "bench",
            "address": "127.0.0.1:1",
            "created_at": "2026-12-07T00:00:00Z",
            "total_bytes": 0,
            "files": [],
        }
    )
    client = PeerClient(TOKEN, SYSTEM_CLOCK, streams=streams)
    try:
        started_cpu, started = cpu(), time.monotonic()
        result = await client.push(
            address,
            header,
            local,
            pace=Pace(0, SYSTEM_CLOCK.monotonic),
            deadline=SYSTEM_CLOCK.monotonic() + 600,
            digests=False,
        )
        seconds, used = time.monotonic() - started, cpu() - started_cpu
    finally:
        await client.close()
    print(json.dumps({"seconds": seconds, "cpu": used, "replica": result.replica_id}))


def read(address: str, mode: str, lanes: int, out: Path, hid: str, sizes: list[int]) -> None:
    """Read every file of holding ``hid`` as a restore from a peer does: in ``lanes``
    ranges at once (a thread and a connection each), each range CRC-32C'd and written with
    ``pwrite`` where it belongs; the ranges' CRCs folded; each file fsynced."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptd.core import checksum
    from ckptd.peers.stream_client import StreamReader
    from ckptd.runtime.clock import SYSTEM_CLOCK

    for old in out.glob("read-*"):
        old.unlink()  # the previous read's output, freed before the clock (module doc)
    reader = StreamReader(TOKEN, SYSTEM_CLOCK)
    started_cpu, started = cpu(), time.monotonic()

    def one_range(fd: int, index: int, start: int, length: int) -> tuple[int, int]:
        crc = 0

        def sink(pos: int, piece: memoryview | bytes) -> None:
            nonlocal crc
            crc = checksum.crc32c(piece, crc)
            mv, at = memoryview(piece), start + pos
            while mv:
                n = os.pwrite(fd, mv, at)
                mv, at = mv[n:], at + n

        if mode == "stream":
            reader.read_range(address, hid, index, start, length, sink)
        else:
            _http_read(address, hid, index, start, length, sink)
        return crc, length

    crcs = []
    with ThreadPoolExecutor(lanes) as pool:
        for index, size in enumerate(sizes):
            fd = os.open(out / f"read-{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            step = -(-size // lanes // MIB) * MIB
            ranges = [(a, min(step, size - a)) for a in range(0, size, step)]
            parts = list(pool.map(lambda r, fd=fd, i=index: one_range(fd, i, *r), ranges))
            os.fsync(fd)
            os.close(fd)
            crcs.append(checksum.to_hex(checksum.combine_parts(parts)))
    seconds, used = time.monotonic() - started, cpu() - started_cpu
    print(json.dumps({"seconds": seconds, "cpu": used, "crc32c": crcs}))


_HTTP = threading.local()


def _http_read(address: str, hid: str, index: int, start: int, length: int, sink: object) -> None:
    """Today's HTTP read (``ckptd.peers.source.PeerReader``'s ranged GET on a kept-alive
    connection per thread), for comparison."""
    import http.client

    from ckptd.peers import auth

    target = f"/v1/peer/holdings/{hid}/files/{index}"
    signed, _ = auth.sign(TOKEN, "GET", target, time.time())
    conn = getattr(_HTTP, "conn", None)
    if conn is None:
        host, _, port = address.rpartition(":")
        conn = _HTTP.conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "GET",
        target,
        headers={"Authorization": signed, "Range": f"bytes={start}-{start + length - 1}"},
    )
    response = conn.getresponse()
    pos = 0
    while pos < length:
        piece = response.read(min(BUF, length - pos))
        if not piece:
            raise SystemExit(f"cut at {start + pos}")
        sink(pos, piece)  # type: ignore[operator]
        pos += len(piece)
    response.read()


def main(argv: list[str]) -> None:
    role, *rest = argv
    if role == "bare-recv":
        bare_recv(rest[0], int(rest[1]), Path(rest[2]))
    elif role == "bare-send":
        bare_send(rest[0], int(rest[1]), rest[2:])
    elif role == "hold":
        asyncio.run(hold(rest[0], int(rest[1]), Path(rest[2]), int(rest[3])))
    elif role == "push":
        asyncio.run(push(rest[0], int(rest[1]), rest[2:]))
    elif role == "read":
        read(rest[0], rest[1], int(rest[2]), Path(rest[3]), rest[4], [int(s) for s in rest[5:]])
    else:
        raise SystemExit(f"no role {role}")


if __name__ == "__main__":
    main(sys.argv[1:])
