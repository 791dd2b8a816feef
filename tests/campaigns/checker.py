"""An independent judge of what a store holds after a fault: nothing of ckptd's code.

It has its own boto3 client, computes CRC-32C with the ``crc32c`` package (ckptd uses
awscrt's), reads the manifest as plain JSON by the layout docs/design.md documents
(``<prefix>/<run>/<name>/ckptd.manifest.json``, ``<prefix>/<run>/LATEST``), and compares
what is committed with the files the campaign wrote. A bug shared by ckptd's checksum,
parser and checker cannot hide here: only the documented format is shared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import crc32c as independent_crc

MANIFEST = "ckptd.manifest.json"
# What stands at an uncommitted slot's manifest key once housekeeping withdrew it (spelled
# here, not imported: the checker reads the contract, docs/design.md "Deleting beside a
# writer: withdrawals").
WITHDRAWN_FORMAT = "ckptd.withdrawn/1"


def crc_hex(data: bytes) -> str:
    return f"{independent_crc.crc32c(data):08x}"


def file_crc(path: Path) -> tuple[int, str]:
    """(size, CRC-32C hex) of a local file, read in 1 MiB pieces."""
    value, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            value = independent_crc.crc32c(chunk, value)
            size += len(chunk)
    return size, f"{value:08x}"


def tree_crcs(root: Path) -> dict[str, tuple[int, str]]:
    """Every regular file under ``root`` by '/'-relative path: (size, CRC-32C hex)."""
    return {
        p.relative_to(root).as_posix(): file_crc(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@dataclass
class Verdict:
    """What the checker found for one run; ``problems`` empty means all is well."""

    committed: dict[str, dict[str, Any]] = field(default_factory=dict)
    latest: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)


class StoreChecker:
    """Reads ``s3://bucket/prefix`` on ``endpoint`` with a client of its own."""

    def __init__(self, endpoint: str, bucket: str, prefix: str, credentials: dict[str, str]):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def keys(self, under: str) -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}/{under}"
        )
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def get(self, key: str) -> bytes | None:
        try:
            return bytes(self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except self.s3.exceptions.NoSuchKey:
            return None

    def manifest(self, run: str, name: str) -> dict[str, Any] | None:
        body = self.get(f"{self.prefix}/{run}/{name}/{MANIFEST}")
        return None if body is None else dict(json.loads(body))

    def committed_names(self, run: str) -> list[str]:
        """The names with a manifest key holding something other than a withdrawal (what
        retention and ``rm`` leave at an uncommitted slot: never a commit). A manifest
        that does not parse counts, so that ``check_run`` reports it."""
        suffix = f"/{MANIFEST}"
        base = f"{self.prefix}/{run}/"
        names = sorted(
            k[len(base) : -len(suffix)]
            for k in self.keys(f"{run}/")
            if k.endswith(suffix) and "/" not in k[len(base) : -len(suffix)]
        )
        return [n for n in names if not self._withdrawn(f"{base}{n}{suffix}")]

    def _withdrawn(self, key: str) -> bool:
        body = self.get(key)
        if body is None:
            return True  # gone since the listing: not committed either
        try:
            doc = json.loads(body)
        except ValueError:
            return False
        return isinstance(doc, dict) and doc.get("format") == WITHDRAWN_FORMAT

    def multipart_uploads(self) -> list[dict[str, Any]]:
        found = self.s3.list_multipart_uploads(Bucket=self.bucket, Prefix=f"{self.prefix}/")
        return list(found.get("Uploads", []))

    def check_run(self, run: str, local: dict[str, dict[str, tuple[int, str]]]) -> Verdict:
        """Every committed checkpoint of ``run`` has every byte its manifest names, equal
        to the local files the campaign wrote (``local``: name -> path -> (size, crc));
        LATEST names a committed checkpoint with the manifest's CRC-32C."""
        verdict = Verdict()
        for name in self.committed_names(run):
            raw = self.get(f"{self.prefix}/{run}/{name}/{MANIFEST}")
            if raw is None:
                continue  # deleted by retention between the listing and the read
            try:
                doc = json.loads(raw)
                files = {f["path"]: (int(f["size"]), f["crc32c"]) for f in doc["files"]}
            except (ValueError, KeyError, TypeError) as exc:
                verdict.problems.append(f"{run}/{name}: manifest unreadable: {exc}")
                continue
            verdict.committed[name] = doc
            if name in local and files != local[name]:
                verdict.problems.append(f"{run}/{name}: manifest differs from the local files")
            if doc.get("total_bytes") != sum(size for size, _ in files.values()):
                verdict.problems.append(f"{run}/{name}: total_bytes is not the sum of sizes")
            for path, (size, crc) in files.items():
                body = self.get(f"{self.prefix}/{run}/{name}/{path}")
                if body is None:
                    verdict.problems.append(f"{run}/{name}/{path}: missing from the store")
                elif len(body) != size or crc_hex(body) != crc:
                    verdict.problems.append(f"{run}/{name}/{path}: wrong bytes in the store")
        raw_latest = self.get(f"{self.prefix}/{run}/LATEST")
        if raw_latest is not None:
            latest = dict(json.loads(raw_latest))
            verdict.latest = latest
            named = latest.get("checkpoint")
            body = self.get(f"{self.prefix}/{run}/{named}/{MANIFEST}")
            if body is None:
                verdict.problems.append(f"{run}/LATEST names {named!r}, which has no manifest")
            elif crc_hex(body) != latest.get("manifest_crc32c"):
                verdict.problems.append(f"{run}/LATEST's manifest_crc32c differs from {named}'s")
        return verdict


def check_restored(target: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems with a restored ``target`` (DIR/NAME) against ``manifest``: [] when it
    holds exactly the manifest's files with their sizes and CRC-32C."""
    want = {f["path"]: (int(f["size"]), f["crc32c"]) for f in manifest["files"]}
    have = tree_crcs(target)
    if have == want:
        return []
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(p for p in set(want) & set(have) if want[p] != have[p])
    return [f"{target}: missing {missing}, extra {extra}, wrong bytes {wrong}"]
