"""Reference: upload every file of a directory with plain boto3 (s3transfer), nothing more.

    python bench/_boto3_upload.py --endpoint-url URL --bucket B --prefix P
        [--part-size-mib 64] [--concurrency 8] DIR

This is what ckptd's transfer path would cost without its own work (its CRC-32C per part,
journal, verification and manifest): one ``s3transfer.TransferManager`` shared by all
files, so small files go up in parallel as they do with the AWS CLI, with ckptd's default
part size and concurrency. botocore's default checksum behaviour is kept (since 1.36 it
sends a CRC32 per request), as a user of boto3 would get it. Credentials come from the
environment.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import boto3
from s3transfer.manager import TransferConfig, TransferManager

MIB = 1024 * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint-url", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--part-size-mib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)

    client = boto3.client("s3", endpoint_url=args.endpoint_url)
    part = args.part_size_mib * MIB
    config = TransferConfig(
        multipart_threshold=part,
        multipart_chunksize=part,
        max_request_concurrency=args.concurrency,
        # Enough buffered parts to keep every request slot busy, as ckptd does.
        max_in_memory_upload_chunks=args.concurrency,
    )
    files = sorted(p for p in args.dir.rglob("*") if p.is_file())
    prefix = args.prefix.strip("/")
    # s3transfer is used directly (not boto3's create_transfer_manager) so the classic
    # threaded uploader is measured on every machine, never the optional CRT one.
    with TransferManager(client, config) as manager:
        futures = [
            manager.upload(str(p), args.bucket, f"{prefix}/{p.relative_to(args.dir).as_posix()}")
            for p in files
        ]
        for future in futures:
            future.result()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
