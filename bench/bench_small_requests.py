"""Small-object PUTs and GETs by three S3 clients: botocore, ckptd's direct path, awscrt.

    .venv/bin/python bench/bench_small_requests.py [--objects 2000] [--size-kib 64]
        [--concurrency 32] [--runs 3] [--clients botocore,direct,crt] [--json FILE]

Why: ckptd sends each small file's PUT and GET by a direct path it signs and sends itself
(``ckptd.storage.s3_direct``) rather than by botocore; awscrt, already a dependency, has
``awscrt.s3.S3Client`` (aws-c-s3, the AWS CLI's CRT transfer client) made for the job.
This measures the three on the same objects, side by side in one run:

- ``botocore``: ``S3Storage``'s own botocore client (ckptd's config: no retries, no
  botocore checksums, unsigned payload) calling ``put_object`` / ``get_object`` from
  ``--concurrency`` threads, the CRC-32C header sent as ckptd sends it;
- ``direct``: ``S3Storage.put_bytes`` / ``get_bytes`` from as many threads, after one
  request through botocore taught the direct path (untimed);
- ``crt``: one ``S3Client`` with ``max_active_connections_override=--concurrency``,
  all requests submitted at once (its own event-loop threads send them), the same
  CRC-32C header, the body unsigned as the others send it.

Each round makes a fresh prefix per client, PUTs ``--objects`` objects of ``--size-kib``
(random bytes, one body per object, CRC-32C computed before timing), then GETs them
all back and compares every byte. Wall and this process's CPU (RUSAGE_SELF: user+sys,
the CRT's threads included) per phase; the median of ``--runs`` rounds, the clients'
order rotated between rounds. One loopback SeaweedFS (``ckptd.devtools.locals3``),
whose CPU is not counted.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptd.core import checksum
from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY, LocalS3
from ckptd.storage.s3 import S3Storage

BUCKET = "ckpt"
Objects = list[tuple[str, bytes, int]]  # key, body, crc32c


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - wall, cpu_seconds() - cpu


class ThreadedClient:
    """botocore or the direct path: one blocking call per object from a thread pool."""

    def __init__(self, storage: S3Storage, concurrency: int, *, direct: bool) -> None:
        self.storage = storage
        self.pool = ThreadPoolExecutor(concurrency)
        self.direct = direct

    def put_all(self, prefix: str, objects: Objects) -> None:
        list(self.pool.map(lambda o: self._put(f"{prefix}/{o[0]}", o[1], o[2]), objects))

    def get_all(self, prefix: str, objects: Objects) -> list[bytes]:
        return list(self.pool.map(lambda o: self._get(f"{prefix}/{o[0]}"), objects))

    def _put(self, key: str, body: bytes, crc: int) -> None:
        if self.direct:
            self.storage.put_bytes(key, body, crc32c=crc)
            return
        self.storage._client.put_object(
            Bucket=BUCKET, Key=key, Body=body, ChecksumCRC32C=checksum.to_base64(crc)
        )

    def _get(self, key: str) -> bytes:
        if self.direct:
            return self.storage.get_bytes(key)
        return bytes(self.storage._client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    def close(self) -> None:
        self.pool.shutdown()


class CrtClient:
    """awscrt.s3.S3Client: every request submitted at once, its connections capped."""

    def __init__(self, endpoint: str, concurrency: int) -> None:
        from awscrt import auth, s3
        from awscrt import io as crt_io

        self.s3 = s3
        self.http = __import__("awscrt.http", fromlist=["HttpHeaders"])
        self.host = endpoint.split("://", 1)[1]
        elg = crt_io.EventLoopGroup()
        bootstrap = crt_io.ClientBootstrap(elg, crt_io.DefaultHostResolver(elg))
        credentials = auth.AwsCredentialsProvider.new_static(ACCESS_KEY, SECRET_KEY)
        signing = auth.AwsSigningConfig(
            algorithm=auth.AwsSigningAlgorithm.V4,
            signature_type=auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
            credentials_provider=credentials,
            region="us-east-1",
            service="s3",
            signed_body_value=auth.AwsSignedBodyValue.UNSIGNED_PAYLOAD,
            signed_body_header_type=auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
        )
        self.client = s3.S3Client(
            bootstrap=bootstrap,
            region="us-east-1",
            tls_mode=s3.S3RequestTlsMode.DISABLED,
            signing_config=signing,
            max_active_connections_override=concurrency,
        )

    def _run(self, requests: list[tuple[Any, Any, dict[str, Any]]]) -> None:
        done = [
            self.client.make_request(type=t, request=r, **kw).finished_future
            for t, r, kw in requests
        ]
        for future in done:
            future.result()

    def put_all(self, prefix: str, objects: Objects) -> None:
        requests = []
        for name, body, crc in objects:
            headers = self.http.HttpHeaders(
                [
                    ("Host", self.host),
                    ("Content-Length", str(len(body))),
                    ("x-amz-checksum-crc32c", checksum.to_base64(crc)),
                ]
            )
            request = self.http.HttpRequest(
                "PUT", f"/{BUCKET}/{prefix}/{name}", headers, io.BytesIO(body)
            )
            requests.append((self.s3.S3RequestType.PUT_OBJECT, request, {}))
        self._run(requests)

    def get_all(self, prefix: str, objects: Objects) -> list[bytes]:
        pieces: list[list[bytes]] = [[] for _ in objects]
        requests = []
        for i, (name, _, _) in enumerate(objects):
            headers = self.http.HttpHeaders([("Host", self.host)])
            request = self.http.HttpRequest("GET", f"/{BUCKET}/{prefix}/{name}", headers)
            sink = pieces[i]

            def on_body(chunk: bytes, offset: int, sink: list[bytes] = sink, **_: Any) -> None:
                sink.append(bytes(chunk))

            requests.append((self.s3.S3RequestType.GET_OBJECT, request, {"on_body": on_body}))
        self._run(requests)
        return [b"".join(p) for p in pieces]

    def close(self) -> None:
        self.client = None


def make_objects(count: int, size: int) -> Objects:
    out = []
    for i in range(count):
        body = os.urandom(size)
        out.append((f"shard_{i:06d}.distcp", body, checksum.crc32c(body)))
    return out


def round_of(name: str, client: Any, prefix: str, objects: Objects) -> dict[str, float]:
    up = timed(lambda: client.put_all(prefix, objects))
    got: list[bytes] = []
    down = timed(lambda: got.extend(client.get_all(prefix, objects)))
    bad = sum(1 for (_, body, _), back in zip(objects, got, strict=True) if body != back)
    if bad:
        raise SystemExit(f"{name}: {bad} objects read back differ from what was written")
    return {"put_wall": up[0], "put_cpu": up[1], "get_wall": down[0], "get_cpu": down[1]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--size-kib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", default="botocore,direct,crt")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    names = args.clients.split(",")
    objects = make_objects(args.objects, args.size_kib * 1024)
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-small-") as tmp:
        os.environ.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
        with LocalS3(Path(tmp) / "s3", buckets=(BUCKET,)) as s3:
            env_pool = max(10, args.concurrency + 4)
            storage = S3Storage(
                BUCKET, endpoint_url=s3.endpoint_url, region="us-east-1", max_connections=env_pool
            )
            storage.put_bytes("warm", b"x", crc32c=checksum.crc32c(b"x"))  # teaches direct
            assert storage._direct.client is not None, "the direct path did not learn"
            clients: dict[str, Any] = {
                "botocore": ThreadedClient(storage, args.concurrency, direct=False),
                "direct": ThreadedClient(storage, args.concurrency, direct=True),
                "crt": CrtClient(s3.endpoint_url, args.concurrency),
            }
            # One untimed warm-up each (connections, imports, first-request setup).
            for name in names:
                round_of(name, clients[name], f"warm-{name}", objects[:50])
            results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
            for r in range(args.runs):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    results[name].append(round_of(name, clients[name], f"r{r}-{name}", objects))
                    print(f"round {r} {name}: {results[name][-1]}", file=sys.stderr)
            for c in clients.values():
                c.close()
    medians = {
        n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in results.items()
    }
    load = os.getloadavg()
    print(
        f"{args.objects} x {args.size_kib} KiB, concurrency {args.concurrency}, median of "
        f"{args.runs}; load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print("| client | PUT wall | PUT CPU | GET wall | GET CPU | CPU per request |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, m in medians.items():
        per = (m["put_cpu"] + m["get_cpu"]) / (2 * args.objects) * 1000
        print(
            f"| {n} | {m['put_wall']:.2f} s | {m['put_cpu']:.2f} CPU-s | {m['get_wall']:.2f} s"
            f" | {m['get_cpu']:.2f} CPU-s | {per:.2f} ms |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "runs": results,
                    "medians": medians,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
