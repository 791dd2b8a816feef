"""Several hosts on one machine: network namespaces on a bridge, each link shaped.

A ``Rig`` is one test's network: a namespace per host (the nodes, the store), one more
holding a bridge, and a veth pair from each host to a port of that bridge. Each link is
shaped on **both** ends (``tbf``, with ``netem`` under it for delay or loss): a qdisc
shapes only what leaves its device, so the host's end paces what it sends and the
bridge's port what it receives (``../shared/facts/netns-test-hosts.md`` has the commands
and the rates measured here). Loss is dropped by nftables in the host (``numgen
random``), both ways: this machine's kernel has no ``netem``. The test process itself joins the bridge through one
more veth pair, unshaped ("the test host"), so it reads the store and asks the daemons
at their addresses like any other host.

Every name is unique to the rig (namespaces ``<tag>-<host>``, the tag random per rig),
and so is the subnet, ``10.231.K.0/24``: K is the first one no route on this machine
names, held by a lock file for the rig's life, so two rigs (two pytest runs) never
collide. Traffic goes only to the rig's own addresses. ``close`` (the fixture's
finally, also after a failed test) deletes every namespace, which takes every veth and
qdisc with it, and the test host's end of its pair.

Measure a link before relying on it (``measure``): on a loaded 2-core machine the CPU,
not the qdisc, may set the rate.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

SUBNET_PREFIX = "10.231"
TEST_HOST_OCTET = 254
_LOCK_DIR = Path("/run/ckptd-netns") if Path("/run").is_dir() else Path("/tmp/ckptd-netns")


class RigUnavailable(Exception):
    """This machine cannot build a rig (not root, no ``ip``/``tc``, no namespaces)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns}: {done.stderr.strip()}")


def check_available() -> None:
    """RigUnavailable naming what is missing, or nothing."""
    if os.geteuid() != 0:
        raise RigUnavailable("network namespaces need root")
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            raise RigUnavailable(f"{tool} (iproute2) is not installed")
    probe = f"ckprobe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise RigUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


@dataclass(frozen=True)
class Shape:
    """One link's shaping, applied to both of its ends."""

    rate_mbit: float | None = None  # None: not rate-limited
    delay_ms: float = 0.0
    loss_percent: float = 0.0

    def __str__(self) -> str:
        parts = [f"{self.rate_mbit:g} Mbit" if self.rate_mbit else "unshaped"]
        if self.delay_ms:
            parts.append(f"delay {self.delay_ms:g} ms")
        if self.loss_percent:
            parts.append(f"loss {self.loss_percent:g}%")
        return ", ".join(parts)


@dataclass
class Host:
    """One host of the rig: its namespace, its address, its link to the bridge."""

    name: str
    ns: str
    address: str
    port: str  # its veth end in the bridge's namespace
    shape: Shape
    dev: str = "eth0"  # its veth end in its own namespace

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (its network; files, users and PIDs are shared)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 120)
        return subprocess.run(self.argv(argv), **kwargs)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv(argv), **kwargs)


def _free_subnet() -> tuple[int, int]:
    """A third octet K no route here names, and the fd of the lock file that holds it."""
    _LOCK_DIR.mkdir(parents=True, exist_ok=True)
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
    for k in range(11, 250):
        if f"{SUBNET_PREFIX}.{k}." in routes:
            continue
        fd = os.open(_LOCK_DIR / f"{k}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return k, fd
    raise RigUnavailable(f"no free subnet under {SUBNET_PREFIX}.0.0/16")


@dataclass
class Rig:
    """One test's hosts on one bridge (module doc). Build with ``Rig.make()``."""

    tag: str
    octet: int
    lock_fd: int
    hosts: dict[str, Host] = field(default_factory=dict)
    test_port: str = ""  # the test host's end, in this (the root) namespace
    closed: bool = False
    added: int = 0  # hosts ever added: each gets an address of its own

    @classmethod
    def make(cls) -> Rig:
        check_available()
        octet, fd = _free_subnet()
        rig = cls(f"ck{secrets.token_hex(3)}", octet, fd)
        try:
            rig._bridge()
        except BaseException:
            rig.close()
            raise
        return rig

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    @property
    def test_address(self) -> str:
        """The test process's own address on the bridge."""
        return f"{SUBNET_PREFIX}.{self.octet}.{TEST_HOST_OCTET}"

    def _bridge(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
        # The test host: one end here (root namespace), the other a bridge port.
        self.test_port = f"{self.tag}t"
        _ip(
            "link",
            "add",
            self.test_port,
            "type",
            "veth",
            "peer",
            "name",
            "pt",
            "netns",
            self.bridge_ns,
        )
        _ip("-n", self.bridge_ns, "link", "set", "pt", "master", "br0", "up")
        _ip("addr", "add", f"{self.test_address}/24", "dev", self.test_port)
        _ip("link", "set", self.test_port, "up")

    def add_host(self, name: str, shape: Shape | None = None) -> Host:
        """A new namespace on the bridge, its link shaped by ``shape`` on both ends."""
        self.added += 1
        index = self.added
        host = Host(
            name,
            f"{self.tag}-{name}",
            f"{SUBNET_PREFIX}.{self.octet}.{index}",
            f"p{index}",
            shape or Shape(),
        )
        _ip("netns", "add", host.ns)
        _ip(
            "link", "add", host.dev, "netns", host.ns, "type", "veth",
            "peer", "name", host.port, "netns", self.bridge_ns,
        )  # fmt: skip
        _ip("-n", self.bridge_ns, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", host.dev)
        _ip("-n", host.ns, "link", "set", host.dev, "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        self.hosts[name] = host
        self.reshape(host, host.shape)
        return host

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def remove_host(self, host: Host) -> None:
        """Delete ``host``'s namespace (its veth pair and qdiscs go with it)."""
        _ip("netns", "del", host.ns, check=False)
        self.hosts.pop(host.name, None)

    def reshape(self, host: Host, shape: Shape) -> None:
        """Shape both ends of ``host``'s link (replacing what was there)."""
        host.shape = shape
        for ns, dev in ((host.ns, host.dev), (self.bridge_ns, host.port)):
            with contextlib.suppress(RuntimeError):
                _tc(ns, "qdisc", "del", "dev", dev, "root")
            if shape.rate_mbit:
                # A burst of at least 4 ms at the rate (the kernel needs one tick's worth,
                # and more keeps a loaded machine from under-shooting), 50 ms of queue.
                burst = max(256 * 1024, int(shape.rate_mbit * 1e6 / 8 * 0.004))
                _tc(
                    ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                    "rate", f"{shape.rate_mbit}mbit", "burst", str(burst), "latency", "50ms",
                )  # fmt: skip
            if shape.delay_ms:
                # netem: not in every kernel (this machine's has none; loss below needs it not)
                where = ["parent", "1:1"] if shape.rate_mbit else ["root"]
                _tc(ns, "qdisc", "add", "dev", dev, *where, "handle", "10:", "netem",
                    "delay", f"{shape.delay_ms}ms")  # fmt: skip
        self._loss(host, shape.loss_percent)

    def _loss(self, host: Host, percent: float) -> None:
        """Drop ``percent`` % of the packets ``host`` sends and of those it receives, at
        random (nftables' ``numgen``: ``netem`` is not built into every kernel)."""
        subprocess.run(
            host.argv(["nft", "delete", "table", "inet", "ckloss"]),
            capture_output=True,
            timeout=30,
        )
        if not percent:
            return
        per_100k = round(percent * 1000)
        rules = (
            "table inet ckloss {\n"
            f"  chain in {{ type filter hook input priority 0; policy accept; "
            f'iifname "{host.dev}" numgen random mod 100000 < {per_100k} drop; }}\n'
            f"  chain out {{ type filter hook output priority 0; policy accept; "
            f'oifname "{host.dev}" numgen random mod 100000 < {per_100k} drop; }}\n'
            "}\n"
        )
        done = subprocess.run(
            host.argv(["nft", "-f", "-"]), input=rules, capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            raise RuntimeError(f"nft in {host.ns}: {done.stderr.strip()}")

    def silence(self, host: Host) -> None:
        """Drop every packet ``host`` sends or receives, silently (nftables): its link
        stays up, so a connect to it waits for its own timeout, where a host whose link is
        down is refused after ~3 s (no ARP answer). ``reshape`` lifts it."""
        rules = (
            "table inet ckloss {\n"
            "  chain in { type filter hook input priority 0; policy drop; }\n"
            "  chain out { type filter hook output priority 0; policy drop; }\n"
            "}\n"
        )
        subprocess.run(
            host.argv(["nft", "delete", "table", "inet", "ckloss"]),
            capture_output=True,
            timeout=30,
        )
        done = subprocess.run(
            host.argv(["nft", "-f", "-"]), input=rules, capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            raise RuntimeError(f"nft in {host.ns}: {done.stderr.strip()}")

    def link(self, host: Host, up: bool) -> None:
        """Set ``host``'s link down (it vanishes: no FIN, no RST) or up again."""
        state = "up" if up else "down"
        _ip("-n", host.ns, "link", "set", host.dev, state)
        _ip("-n", self.bridge_ns, "link", "set", host.port, state)

    def measure(self, sender: Host, receiver: Host, mib: int = 32) -> float:
        """Mbit/s of one TCP flow of ``mib`` MiB from ``sender`` to ``receiver`` (Python
        sockets, as the daemons use)."""
        port = 5201
        server = receiver.popen(
            [sys.executable, "-m", "tests.support.netflow", "sink", receiver.address, str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != b"ready":
                raise RuntimeError(
                    f"sink did not start: {server.stderr.read() if server.stderr else ''!r}"
                )
            sent = sender.run(
                [sys.executable, "-m", "tests.support.netflow", "send", receiver.address,
                 str(port), str(mib)],
                check=True,
            )  # fmt: skip
            return float(sent.stdout.strip())
        finally:
            server.kill()
            server.wait()

    def close(self) -> None:
        """Delete every namespace (their veths and qdiscs go with them) and the lock."""
        if self.closed:
            return
        self.closed = True
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)
        _ip("netns", "del", self.bridge_ns, check=False)
        if self.test_port:
            _ip("link", "del", self.test_port, check=False)  # gone with its peer already
        os.close(self.lock_fd)

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftovers(rig: Rig) -> list[str]:
    """Namespaces of ``rig`` still present (none once it is closed)."""
    names = _ip("netns", "list", check=False).stdout.split()
    return [n for n in names if n.startswith(rig.tag)]


@contextlib.contextmanager
def rig_or_skip() -> Iterator[Rig]:
    """A rig, closed afterwards whatever happens; the test skips with one line where this
    machine cannot build one."""
    try:
        rig = Rig.make()
    except RigUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        yield rig
    finally:
        rig.close()


def wait_listening(host: Host, port: int, timeout: float = 30.0) -> None:
    """Until something accepts on ``host.address:port`` (asked from the test host)."""
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on {host.address}:{port}") from None
            time.sleep(0.1)
