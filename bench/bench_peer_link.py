"""The peer data path against a bare TCP stream into a file with fsync, side by side in one run.

```sh
sudo .venv/bin/python bench/bench_peer_link.py --smoke           # 128 MiB, loopback + veth (~1 min)
sudo .venv/bin/python bench/bench_peer_link.py                   # 1 and 4 GiB, unshaped (~10 min)
sudo .venv/bin/python bench/bench_peer_link.py --shape-mbit 1000,10000 --sizes-gib 1
.venv/bin/python bench/bench_peer_link.py --links loopback       # no root needed
```

Links: ``loopback`` (127.0.0.1), and two network-namespace hosts joined by one veth
pair (``10.231.K.1``-``.2``, K free and locked as ``tests/support/netns.py`` does),
unshaped and then shaped with ``tbf`` on both ends at each ``--shape-mbit``. Per link and
part size (two DCP shards of half the size each, in the page cache), ``--reps`` rounds
of (each round rotates the pushes and the reads by one place: ``order``):

- **bare**: ``sendfile`` of the files on one host; ``recv_into`` a reused buffer,
  ``write``, one ``fsync``, a 1-byte acknowledgement on the other;
- **push stream** / **push http**: ckptd's push (``PeerClient.push``: offer, chunks,
  seal with every file fsynced and acknowledged) to a ``PeerServer`` on the other host,
  over streams (``ckptd.peers.frames``) and over HTTP PUTs (``streams = 0``, the path
  before #46): part complete -> safe on the peer;
- **bare read**: the reads' own baseline, the held replica's files (on the holder's
  disk) sent back to the first host by the bare stream;
- **read stream** / **read http**: the held replica's files read back by the first
  host as a restore reads from a peer (``StreamReader``; the HTTP ranged GET of
  ``PeerReader``): in as many ranges at once as a push has streams, each CRC-32C'd and
  written with ``pwrite``, each file fsynced.

Before every read the held files are dropped from the page cache (``POSIX_FADV_DONTNEED``),
so each read, the bare one included, sends from the holder's disk; every receiver writing
through the page cache frees its previous output just before it receives
(``_peer_link_end.py``'s doc says why that matters on this VM). ``--warmup`` rounds (1)
run first and are not counted.

Each end is a process of its own and counts its own CPU (``getrusage`` around the work,
start-up excluded). The table gives medians, the rate relative to the bare stream of the
same run (a read: to the bare read), and CPU-s per GiB per end and both ends together,
relative to the same baseline's. The header gives the machine and its load: on a loaded
machine compare only within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GIB, MIB, machine_line  # noqa: E402

#: The reads' own baseline: the held replica's files sent back by a bare stream.
READS = ("bare read", "read stream", "read http")

END = str(Path(__file__).resolve().parent / "_peer_link_end.py")
PY = sys.executable
KINDS = ("bare", "push stream", "push http", "bare read", "read stream", "read http")
#: The pushes, then the reads. Within each, every round rotates the order by one, so in
#: three rounds each path takes each place once: where a path runs decides which pages
#: it writes into (here the VM returns freed memory to its host, so a page freed a while
#: ago faults there again) and whether the page cache was just filled by another, and a
#: fixed middle place once made the stream read look twice as dear as it is.
PUSHES = KINDS[:3]


def order(rep: int) -> list[str]:
    """The paths of round ``rep`` (negative: warm-up), pushes first, each group rotated."""

    def turn(group: tuple[str, ...]) -> list[str]:
        k = rep % len(group)
        return [*group[k:], *group[:k]]

    return [*turn(PUSHES), *turn(READS)]


@dataclass
class Link:
    """Where the two ends run: ``argv`` prefixes for each host, and their addresses."""

    name: str
    sender_argv: list[str]
    holder_argv: list[str]
    holder_address: str
    sender_address: str
    cleanup: list[list[str]] = field(default_factory=list)
    lock_fd: int = -1

    def close(self) -> None:
        for argv in self.cleanup:
            subprocess.run(argv, capture_output=True, check=False)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)


def loopback() -> Link:
    return Link("loopback", [], [], "127.0.0.1", "127.0.0.1")


def veth_pair(shape_mbit: float | None) -> Link:
    """Two namespaces on one veth pair, shaped on both ends when ``shape_mbit``."""
    from tests.support.netns import SUBNET_PREFIX, _free_subnet, check_available

    check_available()
    octet, fd = _free_subnet()
    tag = f"ckpl{secrets.token_hex(2)}"
    a, b = f"{tag}-a", f"{tag}-b"
    link = Link(
        f"veth {shape_mbit:g} Mbit" if shape_mbit else "veth unshaped",
        ["ip", "netns", "exec", a],
        ["ip", "netns", "exec", b],
        f"{SUBNET_PREFIX}.{octet}.2",
        f"{SUBNET_PREFIX}.{octet}.1",
        [["ip", "netns", "del", a], ["ip", "netns", "del", b]],
        fd,
    )
    try:
        for argv in (
            ["ip", "netns", "add", a],
            ["ip", "netns", "add", b],
            ["ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"],
            ["ip", "link", "set", f"{tag}a", "netns", a],
            ["ip", "link", "set", f"{tag}b", "netns", b],
            ["ip", "-n", a, "addr", "add", f"{SUBNET_PREFIX}.{octet}.1/24", "dev", f"{tag}a"],
            ["ip", "-n", b, "addr", "add", f"{SUBNET_PREFIX}.{octet}.2/24", "dev", f"{tag}b"],
            ["ip", "-n", a, "link", "set", f"{tag}a", "up"],
            ["ip", "-n", b, "link", "set", f"{tag}b", "up"],
            ["ip", "-n", a, "link", "set", "lo", "up"],
            ["ip", "-n", b, "link", "set", "lo", "up"],
        ):
            subprocess.run(argv, check=True, capture_output=True, timeout=30)
        if shape_mbit:
            burst = max(256 * 1024, int(shape_mbit * 1e6 / 8 * 0.004))
            for ns, dev in ((a, f"{tag}a"), (b, f"{tag}b")):
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                     "tbf", "rate", f"{shape_mbit:g}mbit", "burst", str(burst),
                     "latency", "50ms"],
                    check=True, capture_output=True, timeout=30,
                )  # fmt: skip
    except BaseException:
        link.close()
        raise
    return link


class LongEnd:
    """A long-lived end (``bare-recv``, ``hold``): its port, and its CPU on request."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.port = int(self._line("ready ").split()[1])

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"an end exited: {self.proc.args}")
            if line.startswith(prefix):
                return line

    def cpu(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(json.loads(self._line('{"cpu"'))["cpu"])

    def free(self) -> None:
        """Delete what this end kept (``bare-recv``'s last stream), just before it receives."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("free\n")
        self.proc.stdin.flush()
        self._line('{"freed"')

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def one_shot(argv: list[str]) -> dict[str, Any]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"{argv[:6]} failed: {done.stderr[-2000:]}")


def make_part(base: Path, size: int) -> list[str]:
    files = []
    for i in range(2):
        path = base / f"__{i}_0.distcp"
        with path.open("wb") as f:
            left = size // 2
            block = os.urandom(8 * MIB)
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
        files.append(str(path))
    return files


def held_files(store: Path, replica: str) -> list[str]:
    """The held replica's files on the holder's disk (``ckptd.peers.replicas``' layout), in
    the part's file order."""
    files = sorted(str(p) for p in (store / "held" / replica / "data").rglob("*") if p.is_file())
    if not files:
        raise RuntimeError(f"replica {replica} is not held under {store}")
    return files


def evict(paths: list[str]) -> None:
    """Drop these (clean, fsynced) files from the page cache: every read sends from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_link(
    link: Link, sizes: list[int], reps: int, streams: int, work: Path, warmup: int = 0
) -> list[dict]:
    rows: list[dict[str, Any]] = []
    store = work / "held"
    received = work / "received"
    read_back = work / "read-back"
    for d in (store, received, read_back):
        d.mkdir()
    addr = link.holder_address
    bare = LongEnd([*link.holder_argv, PY, END, "bare-recv", addr, "0", str(received)])
    back = LongEnd(
        [*link.sender_argv, PY, END, "bare-recv", link.sender_address, "0", str(read_back)]
    )
    quota = str(3 * max(sizes))
    holder = LongEnd([*link.holder_argv, PY, END, "hold", addr, "0", str(store), quota])
    try:
        for size in sizes:
            sent = work / "part"
            sent.mkdir()
            files = make_part(sent, size)
            for rep in range(-warmup, reps):
                for kind in order(rep):
                    pushed = [r for r in rows if r["size"] == size and r.get("replica")]
                    if kind in READS and not pushed:
                        continue
                    held: list[str] = []
                    if kind in READS:
                        held = held_files(store, pushed[-1]["replica"])
                        evict(held)
                    far = {"bare": bare, "bare read": back}.get(kind, holder)
                    if kind in ("bare", "bare read"):
                        far.free()  # outside the measured CPU, as the reader frees its own
                    before = far.cpu()
                    if kind == "bare":
                        out = one_shot(
                            [*link.sender_argv, PY, END, "bare-send", addr, str(bare.port), *files]
                        )
                    elif kind == "bare read":
                        out = one_shot(
                            [*link.holder_argv, PY, END, "bare-send", link.sender_address,
                             str(back.port), *held]
                        )  # fmt: skip
                    elif kind.startswith("push"):
                        n = streams if kind == "push stream" else 0
                        out = one_shot(
                            [*link.sender_argv, PY, END, "push", f"{addr}:{holder.port}", str(n),
                             *files]
                        )  # fmt: skip
                    else:
                        mode = "stream" if kind == "read stream" else "http"
                        replica = pushed[-1]["replica"]
                        out = one_shot(
                            [*link.sender_argv, PY, END, "read", f"{addr}:{holder.port}", mode,
                             str(streams), str(received), replica,
                             *(str(size // 2) for _ in files)]
                        )  # fmt: skip
                    far_cpu = far.cpu() - before
                    row = {
                        "link": link.name,
                        "size": size,
                        "rep": rep,
                        "warmup": rep < 0,
                        "kind": kind,
                        "seconds": out["seconds"],
                        "near_cpu": out["cpu"],
                        "far_cpu": far_cpu,
                        "replica": out.get("replica"),
                        "load": os.getloadavg()[0],
                    }
                    rows.append(row)
                    print(
                        f"  {link.name:16} {size / GIB:5.2f} GiB  {kind:12} "
                        f"{'(warm-up) ' if rep < 0 else ''}"
                        f"{out['seconds']:6.2f} s  {size * 8 / out['seconds'] / 1e9:6.2f} Gbit/s  "
                        f"cpu near {out['cpu']:5.2f} far {far_cpu:5.2f}  load {row['load']:.1f}",
                        flush=True,
                    )
            shutil.rmtree(sent)
    finally:
        bare.close()
        back.close()
        holder.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Medians per link, size and kind, against the bare stream of the same run."""
    out = [
        "| link | GiB | path | seconds | Gbit/s | x bare rate | CPU-s/GiB sender | "
        "receiver | both | x bare CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        if r.get("warmup"):
            continue
        groups.setdefault((r["link"], r["size"]), {}).setdefault(r["kind"], []).append(r)
    for (name, size), kinds in groups.items():
        gib = size / GIB

        def med(kind: str, key: str, kinds: dict[str, list[dict[str, Any]]] = kinds) -> float:
            return float(statistics.median(r[key] for r in kinds[kind]))

        for kind in KINDS:
            if kind not in kinds:
                continue
            # A read against the held files sent back bare; a push against the bare stream.
            base = "bare read" if kind in READS and "bare read" in kinds else "bare"
            bare_s = med(base, "seconds")
            bare_cpu = (med(base, "near_cpu") + med(base, "far_cpu")) / gib
            secs = med(kind, "seconds")
            # The sender of a read is the holder (far); of a push or a bare stream, near.
            send, recv = med(kind, "near_cpu") / gib, med(kind, "far_cpu") / gib
            if kind.startswith("read"):
                send, recv = recv, send
            out.append(
                f"| {name} | {gib:g} | {kind} | {secs:.2f} | {size * 8 / secs / 1e9:.2f} | "
                f"{bare_s / secs:.2f} | {send:.2f} | {recv:.2f} | {send + recv:.2f} | "
                f"{(send + recv) / bare_cpu:.2f} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", default="1,4")
    parser.add_argument("--reps", type=int, default=3, help="3: each path in each place once")
    parser.add_argument("--links", default="loopback,veth", help="loopback, veth, or both")
    parser.add_argument("--shape-mbit", default="", help="e.g. 1000,10000 (veth, both ends)")
    parser.add_argument("--streams", type=int, default=0, help="0: the client's default")
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first, not counted")
    parser.add_argument("--smoke", action="store_true", help="128 MiB, one round, unshaped")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sizes = [int(float(s) * GIB) for s in args.sizes_gib.split(",") if s]
    reps, warmup = args.reps, args.warmup
    shapes = [float(s) for s in args.shape_mbit.split(",") if s]
    if args.smoke:
        sizes, reps, shapes, warmup = [128 * MIB], 1, [], 0
    from ckptd.peers.stream_client import STREAMS

    streams = args.streams or STREAMS
    print(f"# bench_peer_link: {machine_line()}; {streams} streams per push", flush=True)
    links: list[tuple[str, float | None]] = []
    wanted = args.links.split(",")
    if "loopback" in wanted:
        links.append(("loopback", None))
    if "veth" in wanted:
        links += [("veth", None), *(("veth", s) for s in shapes)]
    rows: list[dict[str, Any]] = []
    for kind, shape in links:
        link = loopback() if kind == "loopback" else veth_pair(shape)
        work = Path(tempfile.mkdtemp(prefix="ckptd-peer-link-"))
        try:
            rows += run_link(link, sizes, reps, streams, work, warmup)
        finally:
            link.close()
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"({time.monotonic() - started:.0f} s)")
    raise SystemExit(code)
