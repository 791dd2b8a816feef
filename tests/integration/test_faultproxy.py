"""FaultProxy forwards S3 traffic unchanged and fails exactly what its plan says.

Most tests run boto3 through the proxy to a real SeaweedFS; one runs a tiny HTTP/1.1
upstream to reach framing cases SeaweedFS never produces (a chunked request, a refused
``Expect: 100-continue``).
"""

from __future__ import annotations

import http.client
import io
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError, ConnectionClosedError, ReadTimeoutError

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import wait_until
from tests.support.faultproxy import ERROR_KINDS, FaultProxy

MiB = 1 << 20


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    with LocalS3(tmp_path_factory.mktemp("faultproxy-s3")) as server:
        yield server


@pytest.fixture(scope="module")
def proxy(s3: LocalS3) -> Iterator[FaultProxy]:
    with FaultProxy(s3.endpoint_url) as fault_proxy:
        yield fault_proxy


@pytest.fixture(autouse=True)
def _fresh_plan(proxy: FaultProxy) -> Iterator[None]:
    # The proxy is shared by the module; each test starts from no faults and zero counts.
    proxy.clear_faults()
    proxy.reset_counters()
    yield
    proxy.clear_faults()


def make_client(s3: LocalS3, endpoint: str, **config: Any) -> Any:
    """A boto3 S3 client for ``endpoint``; no retries unless ``config`` says otherwise."""
    # "total_max_attempts" counts the first try; "max_attempts": 1 would still allow one
    # retry in standard mode, which would hide an injected fault.
    config.setdefault("retries", {"total_max_attempts": 1})
    env = s3.env()
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        config=Config(**config),
    )


@pytest.fixture
def client(s3: LocalS3, proxy: FaultProxy) -> Any:
    return make_client(s3, proxy.url)


@pytest.fixture
def direct(s3: LocalS3) -> Any:
    """A client that bypasses the proxy, to see what really reached the server."""
    return make_client(s3, s3.endpoint_url)


def new_key(prefix: str = "obj") -> str:
    return f"{prefix}/{uuid.uuid4().hex}"


def exists_upstream(direct: Any, key: str) -> bool:
    try:
        direct.head_object(Bucket="ckpt", Key=key)
    except ClientError as exc:
        if exc.response["Error"]["Code"] in ("404", "NoSuchKey"):
            return False
        raise
    return True


# -- transparent forwarding -------------------------------------------------------------


def test_put_get_list_pass_through_byte_identical(
    proxy: FaultProxy, client: Any, direct: Any
) -> None:
    prefix = new_key("list")
    bodies = {f"{prefix}/{i}": os.urandom(1000 + i) for i in range(3)}
    for key, body in bodies.items():
        client.put_object(Bucket="ckpt", Key=key, Body=body)

    for key, body in bodies.items():
        assert client.get_object(Bucket="ckpt", Key=key)["Body"].read() == body
        assert direct.get_object(Bucket="ckpt", Key=key)["Body"].read() == body
    listing = client.list_objects_v2(Bucket="ckpt", Prefix=prefix + "/")
    assert {o["Key"]: o["Size"] for o in listing["Contents"]} == {
        k: len(v) for k, v in bodies.items()
    }
    assert proxy.faults_injected == 0
    assert all(r.status in (200, 206) for r in proxy.requests)


def test_multipart_upload_of_20mib_reads_back_identical(
    proxy: FaultProxy, client: Any, direct: Any
) -> None:
    key = new_key("multipart")
    data = os.urandom(20 * MiB)
    parts = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)

    client.upload_fileobj(io.BytesIO(data), "ckpt", key, Config=parts)

    queries = [r.query for r in proxy.requests if r.path == f"/ckpt/{key}"]
    assert "uploads" in queries
    assert sum("partNumber=" in q for q in queries) == 4
    assert proxy.bytes_up_by("PUT") == len(data)  # part bodies, counted exactly
    out = io.BytesIO()
    client.download_fileobj("ckpt", key, out, Config=parts)
    assert out.getvalue() == data
    assert direct.get_object(Bucket="ckpt", Key=key)["Body"].read() == data


def test_bytes_up_counts_request_body_bytes_exactly(proxy: FaultProxy, client: Any) -> None:
    body = os.urandom(123_457)

    client.put_object(Bucket="ckpt", Key=new_key(), Body=body)
    client.list_objects_v2(Bucket="ckpt", MaxKeys=1)

    assert proxy.bytes_up == len(body)
    assert proxy.bytes_up_by("PUT") == len(body)
    assert proxy.bytes_up_by("GET") == 0
    assert [(r.method, r.bytes_up) for r in proxy.requests] == [("PUT", len(body)), ("GET", 0)]


def test_works_for_a_client_in_another_process(
    s3: LocalS3, proxy: FaultProxy, direct: Any, tmp_path: Path
) -> None:
    key = new_key("subprocess")
    proxy.fail_next(1, "503-slowdown", methods={"PUT"})
    script = (
        "import boto3, sys\n"
        "s3 = boto3.client('s3', endpoint_url=sys.argv[1])\n"
        "s3.put_object(Bucket='ckpt', Key=sys.argv[2], Body=b'from a child')\n"
    )
    env = {**os.environ, **s3.env(), "AWS_CONFIG_FILE": str(tmp_path / "none")}

    subprocess.run([sys.executable, "-c", script, proxy.url, key], env=env, check=True, timeout=30)

    assert proxy.faults_injected == 1  # the child's default retries rode out the 503
    assert direct.get_object(Bucket="ckpt", Key=key)["Body"].read() == b"from a child"


def test_wait_for_sees_an_upload_in_flight_and_times_out(s3: LocalS3, proxy: FaultProxy) -> None:
    body = os.urandom(8 * MiB)
    # boto3 clients are thread-safe, but a fresh one keeps this thread's pool out of it.
    uploader = threading.Thread(
        target=make_client(s3, proxy.url).put_object,
        kwargs={"Bucket": "ckpt", "Key": new_key(), "Body": body},
    )
    uploader.start()
    proxy.wait_for(lambda p: p.count("PUT") == 1, timeout=20)
    uploader.join(timeout=20)
    assert proxy.bytes_up_by("PUT") == len(body)

    with pytest.raises(TimeoutError):
        proxy.wait_for(lambda p: p.count("DELETE") > 0, timeout=0.05)


# -- faults -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(ERROR_KINDS))
def test_error_fault_surfaces_as_its_s3_error_and_writes_nothing(
    kind: str, proxy: FaultProxy, client: Any, direct: Any
) -> None:
    key = new_key(kind)
    proxy.fail_next(1, kind)

    with pytest.raises(ClientError) as raised:
        client.put_object(Bucket="ckpt", Key=key, Body=os.urandom(2 * MiB))

    status, _, code, _ = ERROR_KINDS[kind]
    assert raised.value.response["Error"]["Code"] == code
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert not exists_upstream(direct, key)
    assert proxy.bytes_up == 0
    assert [(r.status, r.fault) for r in proxy.requests] == [(status, kind)]


def test_reset_mid_body_is_a_connection_error_and_writes_nothing(
    proxy: FaultProxy, client: Any, direct: Any
) -> None:
    key = new_key("reset")
    proxy.fail_next(1, "reset")

    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket="ckpt", Key=key, Body=os.urandom(4 * MiB))

    assert not exists_upstream(direct, key)
    assert proxy.bytes_up == 0
    # The same client recovers on a fresh connection.
    client.put_object(Bucket="ckpt", Key=key, Body=b"second try")
    assert exists_upstream(direct, key)


def test_timeout_holds_the_request_until_the_client_gives_up(
    s3: LocalS3, proxy: FaultProxy, client: Any, direct: Any
) -> None:
    key = new_key("timeout")
    client.put_object(Bucket="ckpt", Key=key, Body=b"x")
    impatient = make_client(s3, proxy.url, read_timeout=0.3)
    proxy.stall_seconds = 3.0  # outlives the client's timeout, then lets go
    try:
        proxy.fail_next(1, "timeout", methods={"GET"})
        with pytest.raises(ReadTimeoutError):
            impatient.get_object(Bucket="ckpt", Key=key)
    finally:
        proxy.stall_seconds = 30.0
    assert impatient.get_object(Bucket="ckpt", Key=key)["Body"].read() == b"x"


def test_reset_after_upstream_loses_the_response_not_the_write(
    proxy: FaultProxy, client: Any, direct: Any
) -> None:
    key = new_key("lost-response")
    body = os.urandom(MiB)
    proxy.fail_next(1, "reset-after-upstream")

    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket="ckpt", Key=key, Body=body)

    assert direct.get_object(Bucket="ckpt", Key=key)["Body"].read() == body
    assert proxy.bytes_up == len(body)


def test_fail_next_fails_exactly_the_matching_requests(
    proxy: FaultProxy, client: Any, direct: Any
) -> None:
    proxy.fail_next(2, "503-slowdown", match=lambda method, path: path.endswith("/victim"))
    prefix = new_key("fail-next")

    client.put_object(Bucket="ckpt", Key=f"{prefix}/bystander", Body=b"ok")
    for _ in range(2):
        with pytest.raises(ClientError, match="SlowDown"):
            client.put_object(Bucket="ckpt", Key=f"{prefix}/victim", Body=b"no")
    client.put_object(Bucket="ckpt", Key=f"{prefix}/victim", Body=b"yes")

    assert [r.fault for r in proxy.requests] == [None, "503-slowdown", "503-slowdown", None]
    assert direct.get_object(Bucket="ckpt", Key=f"{prefix}/victim")["Body"].read() == b"yes"


def test_deny_fails_every_matching_request_until_cleared(
    proxy: FaultProxy, client: Any, direct: Any
) -> None:
    key = new_key("deny")
    client.put_object(Bucket="ckpt", Key=key, Body=b"before")
    proxy.deny("403-accessdenied", methods={"PUT"})

    for _ in range(3):
        with pytest.raises(ClientError, match="AccessDenied"):
            client.put_object(Bucket="ckpt", Key=key, Body=b"denied")
    assert client.get_object(Bucket="ckpt", Key=key)["Body"].read() == b"before"

    proxy.clear_faults()
    client.put_object(Bucket="ckpt", Key=key, Body=b"after")
    assert direct.get_object(Bucket="ckpt", Key=key)["Body"].read() == b"after"
    assert proxy.faults_injected == 3


def test_rate_with_seed_fails_about_that_share_reproducibly(proxy: FaultProxy, client: Any) -> None:
    key = new_key("rate")
    client.put_object(Bucket="ckpt", Key=key, Body=b"x")

    def failed_indices() -> list[int]:
        proxy.set_faults(rate=0.5, kinds=("500", "503-slowdown"), methods={"HEAD"}, seed=42)
        failed = []
        for i in range(100):
            try:
                client.head_object(Bucket="ckpt", Key=key)
            except ClientError:
                failed.append(i)
        return failed

    first = failed_indices()
    assert 35 <= len(first) <= 65
    assert proxy.faults_injected == len(first)
    assert failed_indices() == first  # same seed, same requests: same faults


def test_standard_retries_ride_out_a_30_percent_fault_rate(
    s3: LocalS3, proxy: FaultProxy, direct: Any
) -> None:
    retrying = make_client(s3, proxy.url, retries={"mode": "standard", "total_max_attempts": 10})
    proxy.set_faults(rate=0.3, kinds=("500", "503-slowdown", "reset"), methods={"PUT"}, seed=7)
    prefix = new_key("retry")
    bodies = {f"{prefix}/{i}": os.urandom(64 * 1024) for i in range(20)}

    for key, body in bodies.items():
        retrying.put_object(Bucket="ckpt", Key=key, Body=body)

    assert proxy.faults_injected >= 5  # seed 7 gives resets and 500s, not a lucky run
    assert proxy.count("PUT", faulted=False) == 20
    for key, body in bodies.items():
        assert direct.get_object(Bucket="ckpt", Key=key)["Body"].read() == body


# -- HTTP framing SeaweedFS does not produce ----------------------------------------------


class _EchoHandler(BaseHTTPRequestHandler):
    """Echoes request bodies back chunked; refuses ``/refuse`` before its body."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[int, str, str]]  # (client port, Host, path), set per server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep pytest output clean

    def handle_expect_100(self) -> bool:
        if self.path == "/refuse":
            self.send_error(403, "refused before the body")
            return False
        return super().handle_expect_100()

    def _read_body(self) -> bytes:
        if "chunked" not in self.headers.get("Transfer-Encoding", ""):
            return self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = b""
        while size := int(self.rfile.readline().split(b";")[0], 16):
            body += self.rfile.read(size)
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b""):
            pass  # trailers
        return body

    def _reply_chunked(self, body: bytes) -> None:
        self.seen.append((self.client_address[1], self.headers["Host"], self.path))
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(body), 1000):
            piece = body[start : start + 1000]
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def do_PUT(self) -> None:
        self._reply_chunked(self._read_body())

    def do_GET(self) -> None:
        self._reply_chunked(b"abc" * 5000)


def test_chunked_bodies_keep_alive_and_refused_expect_against_a_plain_server() -> None:
    class Handler(_EchoHandler):
        seen: list[tuple[int, str, str]] = []

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_address[1]}") as proxy:
            host, port = "127.0.0.1", int(proxy.url.rsplit(":", 1)[1])
            conn = http.client.HTTPConnection(host, port, timeout=10)
            body = os.urandom(300_000)
            pieces = (body[i : i + 7000] for i in range(0, len(body), 7000))
            conn.request("PUT", "/echo", body=pieces, encode_chunked=True)
            assert conn.getresponse().read() == body
            conn.request("GET", "/stream")
            assert conn.getresponse().read() == b"abc" * 5000
            conn.close()

            seen = Handler.seen
            assert [path for _, _, path in seen] == ["/echo", "/stream"]
            assert seen[0][0] == seen[1][0]  # one upstream connection, kept alive
            assert {h for _, h, _ in seen} == {f"{host}:{port}"}  # Host passed unchanged
            assert proxy.bytes_up == len(body)  # payload, not chunk framing

            # Upstream answers before the body: relay it, then close, since the client
            # may or may not send the body it announced.
            with socket.create_connection((host, port), timeout=10) as raw:
                raw.sendall(
                    b"PUT /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n"
                    b"Expect: 100-continue\r\n\r\n"
                )
                received = b""
                while chunk := raw.recv(65536):
                    received += chunk
            assert received.startswith(b"HTTP/1.1 403 ")
            assert [r.status for r in proxy.requests][-1] == 403
            assert proxy.bytes_up == len(body)
    finally:
        server.shutdown()
        server.server_close()


def test_hold_delays_matching_requests_which_arrivals_list_while_held(
    proxy: FaultProxy, client: Any
) -> None:
    bucket = "ckpt"
    proxy.hold(0.5, lambda method, path, query: method == "PUT" and path.endswith("/held"))
    done = threading.Event()

    def put() -> None:
        client.put_object(Bucket=bucket, Key="held", Body=b"x")
        done.set()

    worker = threading.Thread(target=put)
    worker.start()
    # Listed on arrival, before its answer: the held request is in arrivals, not requests.
    wait_until(lambda: any(t.endswith("/held") for _, t in proxy.arrivals), 5, "arrival")
    assert proxy.held == 1
    assert not done.is_set()
    assert not any(r.path.endswith("/held") for r in proxy.requests)
    worker.join(timeout=10)
    assert done.is_set()
    client.put_object(Bucket=bucket, Key="not-held", Body=b"y")  # no match: not delayed
    assert proxy.held == 1
    proxy.hold(0)
    client.put_object(Bucket=bucket, Key="held", Body=b"z")
    assert proxy.held == 1


def test_ignore_create_only_makes_a_conditional_put_replace_and_is_signed_anew(
    s3: LocalS3, proxy: FaultProxy, client: Any, direct: Any
) -> None:
    """The stand-in for a store that ignores If-None-Match: SeaweedFS itself refuses a
    second create-only PUT; through the proxy in this mode the header is dropped and the
    request signed again (SeaweedFS checks SigV4, so a stale signature would be refused),
    and the second PUT replaces the first, as such a store does."""
    key = new_key("create-only")
    client.put_object(Bucket="ckpt", Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket="ckpt", Key=key, Body=b"second", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    env = s3.env()
    proxy.ignore_create_only(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    client.put_object(Bucket="ckpt", Key=key, Body=b"second", IfNoneMatch="*")
    assert direct.get_object(Bucket="ckpt", Key=key)["Body"].read() == b"second"
    assert proxy.create_only_dropped == 1
    client.put_object(Bucket="ckpt", Key=key, Body=b"plain")  # no header: left as it is
    assert proxy.create_only_dropped == 1
    proxy.clear_faults()
    with pytest.raises(ClientError):
        client.put_object(Bucket="ckpt", Key=key, Body=b"third", IfNoneMatch="*")
