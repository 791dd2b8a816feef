"""Upload a directory, or download a prefix, with one of boto3's two transfer clients.

    python bench/_client_transfer.py --client classic|crt --direction up|down
        --endpoint-url URL --bucket B --prefix P [--part-size-mib N] [--concurrency N] DIR

``up`` uploads every file under DIR to ``P/<relative path>``; ``down`` downloads every
object under ``P/`` into DIR (made if missing). Path-style addressing, plain HTTP,
credentials from the environment. Prints one JSON line on stdout: start-up (imports and
client creation) and transfer (listing included) wall and CPU seconds of this process,
from ``time.perf_counter`` and ``getrusage(RUSAGE_SELF)``, its peak RSS and thread count.

The knobs each client has, and what this script sets:

- classic (``s3transfer.manager.TransferManager`` on a boto3 client, Python threads):
  ``multipart_threshold`` = ``multipart_chunksize`` = ``--part-size-mib``,
  ``max_request_concurrency`` = ``--concurrency``, ``max_in_memory_upload_chunks`` =
  ``--concurrency`` (as ckptd and ``_boto3_upload.py``); other knobs (io_chunksize,
  download queue sizes) at their defaults. Runs with ``BOTO_DISABLE_CRT=true`` (unless
  the environment says otherwise), as ckptd does: botocore's own signer and CRC32.
- crt (``s3transfer.crt.CRTTransferManager`` on an ``awscrt.s3.S3Client``, native
  threads): ``part_size`` = ``--part-size-mib`` (also its multipart threshold);
  ``num_threads`` (event-loop threads, default one per CPU) is left at its default;
  ``target_throughput`` (which sets its connection count, hence how many parts it holds
  in memory) is ``--crt-target-gbps``, default the recommended value for the instance,
  else 10 Gb/s; ``--concurrency`` does not apply. It cannot be
  built with boto3's ``create_transfer_manager(preferred_transfer_client="crt")``, which
  ignores ``endpoint_url`` and always targets AWS over TLS, so it is put together here
  from ``s3transfer.crt``. ``BOTO_DISABLE_CRT`` is removed for it.
"""

from __future__ import annotations

import os
import resource
import sys
import time

T0, R0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)

import argparse  # noqa: E402 - after the clock starts: imports are start-up
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

MIB = 1024 * 1024
REGION = "us-east-1"


def cpu(a: resource.struct_rusage, b: resource.struct_rusage) -> float:
    return (b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime)


def threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def make_manager(
    kind: str, url: str, part: int, concurrency: int, target_gbps: float | None
) -> tuple[Any, Any]:
    """(transfer manager, botocore S3 client for listing) for ``kind``."""
    if kind == "crt":
        os.environ.pop("BOTO_DISABLE_CRT", None)
    else:
        os.environ.setdefault("BOTO_DISABLE_CRT", "true")
    import botocore.session
    from botocore.config import Config

    session = botocore.session.Session()
    config = Config(s3={"addressing_style": "path"})
    client = session.create_client("s3", region_name=REGION, endpoint_url=url, config=config)
    if kind == "classic":
        from s3transfer.manager import TransferConfig, TransferManager

        tc = TransferConfig(
            multipart_threshold=part,
            multipart_chunksize=part,
            max_request_concurrency=concurrency,
            max_in_memory_upload_chunks=concurrency,
        )
        return TransferManager(client, tc), client
    from s3transfer.crt import (
        BotocoreCRTCredentialsWrapper,
        BotocoreCRTRequestSerializer,
        CRTTransferManager,
        create_s3_crt_client,
    )

    creds = BotocoreCRTCredentialsWrapper(session.get_credentials()).to_crt_credentials_provider()
    target = int(target_gbps * 1e9 / 8) if target_gbps else None  # bytes/s
    crt = create_s3_crt_client(
        REGION, creds, use_ssl=False, part_size=part, target_throughput=target
    )
    serializer = BotocoreCRTRequestSerializer(
        session, {"region_name": REGION, "endpoint_url": url, "config": config}
    )
    return CRTTransferManager(crt, serializer), client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=("classic", "crt"), required=True)
    parser.add_argument("--direction", choices=("up", "down"), required=True)
    parser.add_argument("--endpoint-url", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--part-size-mib", type=int, default=None, help="default 64 up, 16 down")
    parser.add_argument("--concurrency", type=int, default=8, help="classic only")
    parser.add_argument("--crt-target-gbps", type=float, default=None, help="crt only")
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    part_mib = args.part_size_mib or (64 if args.direction == "up" else 16)
    prefix = args.prefix.strip("/")

    manager, client = make_manager(
        args.client, args.endpoint_url, part_mib * MIB, args.concurrency, args.crt_target_gbps
    )
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    n = size = 0
    with manager:
        futures = []
        if args.direction == "up":
            for p in sorted(p for p in args.dir.rglob("*") if p.is_file()):
                key = f"{prefix}/{p.relative_to(args.dir).as_posix()}"
                futures.append(manager.upload(str(p), args.bucket, key))
                n, size = n + 1, size + p.stat().st_size
        else:
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=args.bucket, Prefix=prefix + "/"
            )
            for obj in (o for page in pages for o in page.get("Contents", [])):
                dest = args.dir / obj["Key"][len(prefix) + 1 :]
                dest.parent.mkdir(parents=True, exist_ok=True)
                futures.append(manager.download(args.bucket, obj["Key"], str(dest)))
                n, size = n + 1, size + int(obj["Size"])
        for future in futures:
            future.result()
        nthreads = threads()  # while the manager's threads still exist
    t2, r2 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    doc = {
        "client": args.client,
        "direction": args.direction,
        "part_size_mib": part_mib,
        "files": n,
        "bytes": size,
        "startup_s": t1 - T0,
        "startup_cpu_s": cpu(R0, r1),
        "transfer_s": t2 - t1,
        "transfer_cpu_s": cpu(r1, r2),
        "maxrss_kib": r2.ru_maxrss,
        "threads": nthreads,
    }
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
