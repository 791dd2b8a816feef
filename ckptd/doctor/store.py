"""``ckptd doctor``'s checks of one destination: credentials, that it exists and takes a
write, that create-only writes are refused the second time, the checksums it reports,
and its clock.

Invariant: nothing is written, read or deleted outside ``PROBE_DIR`` under the
destination (``<prefix>/.ckptd-doctor/<uuid>...``), and every probe written is deleted
before the checks return, whatever they found. Requests are tried at most
``PROBE_ATTEMPTS`` times, so a dead endpoint costs seconds, not a command's long retries;
the first, which finds whether the store answers at all, gets ``PROBE_DEADLINE_SECONDS``
in all, so an endpoint that accepts connections and never answers (a wrong port, a
proxy or firewall that holds them) fails in that time, saying so, rather than after the
client's two 60 s read timeouts. On s3:// each later request waits as long for its answer.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptd.config import DestinationConfig
from ckptd.core import checksum
from ckptd.core.url import parse_destination
from ckptd.doctor.findings import Finding, Status, clock_finding, clock_skew
from ckptd.storage import open_destination
from ckptd.storage.base import (
    ConditionalWrite,
    PreconditionFailedError,
    Storage,
    StorageError,
    StoreChecksums,
    capability,
)
from ckptd.storage.retrying import RetryingStorage

PROBE_DIR = ".ckptd-doctor"
PROBE_ATTEMPTS = 2
# The first request's whole time, its tries included (module doc), and an s3:// request's
# wait for an answer: a store's HEAD answers in well under a second.
PROBE_DEADLINE_SECONDS = 10.0
PROBE_BYTES = 4096
# Codes by which a store says who is asking is refused: the credentials, not the bucket.
CREDENTIAL_CODES = frozenset(
    {
        "NoCredentials",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "InsufficientAccountPermissions",
        "AccountIsDisabled",
        "KeyBasedAuthenticationNotPermitted",
    }
)
# Where to read what each store needs, said in each fix.
PERMISSIONS = {
    "s3": "s3:ListBucket on the bucket, s3:PutObject, s3:GetObject and s3:DeleteObject on "
    "the prefix (docs/stores.md)",
    "gs": "roles/storage.objectUser on the bucket (docs/stores.md)",
    "az": "Storage Blob Data Contributor on the container (docs/stores.md)",
    "file": "write access for the daemon's user to the directory",
}
# Stores known to honour create-only writes, said in the fix of one that does not.
HONOURING = (
    "AWS S3, SeaweedFS or a recent MinIO; Google Cloud Storage by gs:// (its S3 endpoint "
    "ignores If-None-Match); Azure Blob by az://; or a shared filesystem by file://"
)


@dataclass
class DestinationChecks:
    """The checks of one destination, in order; each needs the ones before it to pass."""

    config: DestinationConfig
    where: str = ""  # the tier's name when there are several
    clock: Callable[[], float] = time.time
    findings: list[Finding] = field(default_factory=list)
    _written: list[str] = field(default_factory=list)
    # Set once the first request outlived its deadline: its thread tries no more.
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> list[Finding]:
        """Every check of the destination; the probes deleted whatever happens."""
        url = self.config.url
        kind = parse_destination(url).kind
        try:
            storage = open_destination(
                self.config.model_copy(update={"max_attempts": PROBE_ATTEMPTS}),
                concurrency=1,
                stop=self._stop,
                read_timeout=PROBE_DEADLINE_SECONDS,
            )
        except (StorageError, ValueError) as exc:
            self._skip("credentials", f"{url}: not known (the destination cannot be opened)")
            self._fail("destination", f"{url}: {exc}", f"fix destination.url ({url})")
            self._skip_rest("destination")
            return self.findings
        try:
            if self._reachable(storage, kind) and self._round_trip(storage, kind):
                self._create_only(storage)
        finally:
            self._clean_up(storage)
        return self.findings

    # -- the checks ----------------------------------------------------------------------

    def _reachable(self, storage: RetryingStorage, kind: str) -> bool:
        url = storage.url
        try:
            if not _within(PROBE_DEADLINE_SECONDS, storage.probe):  # a probe's few quick tries
                self._stop.set()  # its thread gives up after the request in flight
                where = self.config.endpoint_url or url
                self._skip("credentials", f"{url}: the store did not answer")
                self._fail(
                    "destination",
                    f"{url}: no answer from {where} within {PROBE_DEADLINE_SECONDS:g} s "
                    "(it may accept connections and never reply)",
                    "check destination.endpoint_url (host and port) and that this node can "
                    "reach the store through any proxy or firewall",
                )
                return self._skip_rest("destination")
        except StorageError as exc:
            if exc.code in CREDENTIAL_CODES:
                self._fail(
                    "credentials",
                    f"{url}: the store refused them: {exc}",
                    f"give this node credentials the store accepts, with {PERMISSIONS[kind]}",
                )
                return self._skip_rest("credentials")
            if exc.code == "NoSuchBucket":
                self._ok("credentials", f"{url}: the store accepted them")
                self._fail("destination", str(exc), _create_fix(url, kind))
            elif exc.transient:
                self._skip("credentials", f"{url}: the store did not answer")
                self._fail(
                    "destination",
                    f"{url}: the store did not answer: {exc}",
                    "check destination.endpoint_url and that this node can reach it",
                )
            else:
                self._skip("credentials", f"{url}: not known (the destination failed)")
                self._fail("destination", f"{url}: {exc}", f"check destination.url ({url})")
            return self._skip_rest("destination")
        self._ok(
            "credentials",
            f"{url}: none needed" if kind == "file" else f"{url}: the store accepted them",
        )
        return True

    def _round_trip(self, storage: Storage, kind: str) -> bool:
        """Write, read back, head and delete a probe: the destination takes writes."""
        key = self._probe_key()
        data = os.urandom(PROBE_BYTES)
        crc = checksum.crc32c(data)
        try:
            sent = self.clock()
            written = storage.put_bytes(key, data, crc32c=crc)
            answered = self.clock()
            back = storage.get_bytes(key)
            info = storage.head(key)
            storage.delete([key])
            gone = storage.head(key) is None
        except StorageError as exc:
            what = "denied" if exc.code in CREDENTIAL_CODES else "failed"
            self._fail(
                "destination",
                f"{storage.url}: a probe write, read or delete {what}: {exc}",
                f"grant {PERMISSIONS[kind]}",
            )
            return self._skip_rest("destination")
        if back != data or info is None or info.size != len(data):
            self._fail(
                "destination",
                f"{storage.url}: the probe {key} read back {len(back)} bytes that differ from "
                f"the {len(data)} written",
                "this store does not return what it was given: do not use it for checkpoints",
            )
            return self._skip_rest("destination")
        self._ok(
            "destination",
            f"{storage.url}: a probe written, read back identical and deleted ({key})"
            + (
                "" if gone else "; it still lists after the delete (an eventually consistent store)"
            ),
        )
        self._checksums(storage, kind, written.checksum or info.checksum, crc)
        if info.modified:
            self.findings.append(
                clock_finding(clock_skew(info.modified, sent, answered), storage.url, self.where)
            )
        else:
            self._warn(
                "clock",
                f"{storage.url}: the store gave no time for the probe: its clock is not known",
                "nothing to do unless several nodes disagree on time",
            )
        return True

    def _checksums(self, storage: Storage, kind: str, reported: str, crc: int) -> None:
        sums = capability(storage, StoreChecksums)
        if sums is None:
            self._ok(
                "checksums",
                f"{storage.url}: the {kind}:// store keeps no CRC-32C: each object is checked "
                "by its size after upload, every byte by restore and verify",
            )
            return
        expected = sums.expected_checksum([], crc)
        if not reported:
            self._warn(
                "checksums",
                f"{storage.url}: the store reported no CRC-32C for the probe: uploads are "
                "verified by size only, so a byte changed in transit or at rest is found only "
                "when `ckptd verify` or a restore re-reads it",
                "use a store (or version) that returns x-amz-checksum-crc32c",
            )
        elif not checksum.s3_checksums_match(reported, expected):
            self._fail(
                "checksums",
                f"{storage.url}: the store reported CRC-32C {reported} for bytes whose "
                f"CRC-32C is {expected}",
                "the store changes or misreports what it holds: do not use it for checkpoints",
            )
        else:
            self._ok("checksums", f"{storage.url}: the store reported the CRC-32C ckptd sent")

    def _create_only(self, storage: Storage) -> None:
        """A create-only write twice: the second must be refused, the first kept."""
        writer = capability(storage, ConditionalWrite)
        if writer is None:
            self._fail(
                "create-only",
                f"{storage.url}: this backend has no create-only write (ConditionalWrite)",
                f"use a store ckptd can commit to: {HONOURING}",
            )
            return
        key = self._probe_key("create-only")
        first, second = os.urandom(64), os.urandom(64)
        try:
            writer.put_if_absent(key, first, crc32c=checksum.crc32c(first))
            try:
                writer.put_if_absent(key, second, crc32c=checksum.crc32c(second))
                refused = False
            except PreconditionFailedError:
                refused = True
            kept = storage.get_bytes(key)
        except StorageError as exc:
            self._fail(
                "create-only",
                f"{storage.url}: a create-only write failed: {exc}",
                f"the store must take conditional writes (If-None-Match: *): {HONOURING}",
            )
            return
        if refused and kept == first:
            self._ok(
                "create-only",
                f"{storage.url}: a second create-only write of {key} was refused, the first kept",
            )
            return
        what = "replaced the first" if kept == second else "left neither intact"
        if refused:
            what = "was refused, yet the object changed"
        self._fail(
            "create-only",
            f"{storage.url}: the store ignores create-only writes: a second write of {key} "
            f"with If-None-Match: * {what}. ckptd commits a checkpoint by writing its "
            "manifest once; on this store two nodes (or a retry) could commit different "
            "content under one name",
            f"use a store that honours conditional writes: {HONOURING} (or upgrade this one)",
        )

    # -- bookkeeping ---------------------------------------------------------------------

    def _probe_key(self, suffix: str = "") -> str:
        key = f"{PROBE_DIR}/{uuid.uuid4().hex}" + (f"-{suffix}" if suffix else "")
        self._written.append(key)
        return key

    def _clean_up(self, storage: Storage) -> None:
        if not self._written:
            return
        try:
            storage.delete(list(self._written))
        except StorageError as exc:
            self._warn(
                "destination",
                f"{storage.url}: a probe could not be deleted: {exc}",
                f"delete {', '.join(self._written)} under {storage.url} by hand",
            )

    def _add(self, check: str, status: Status, message: str, fix: str = "") -> None:
        self.findings.append(Finding(check, status, message, fix, self.where))

    def _ok(self, check: str, message: str) -> None:
        self._add(check, "ok", message)

    def _warn(self, check: str, message: str, fix: str) -> None:
        self._add(check, "warn", message, fix)

    def _fail(self, check: str, message: str, fix: str) -> None:
        self._add(check, "fail", message, fix)

    def _skip(self, check: str, message: str) -> None:
        self._add(check, "skip", message)

    def _skip_rest(self, after: str) -> bool:
        """Every later check skipped, because ``after`` failed; False (for ``return``)."""
        order = ["credentials", "destination", "checksums", "clock", "create-only"]
        for check in order[order.index(after) + 1 :]:
            self._skip(check, f"not checked: {after} failed")
        return False


def _within(seconds: float, request: Callable[[], None]) -> bool:
    """Run ``request`` for at most ``seconds``: True when it returned, its exception
    raised here; False when it had not finished by then. Its thread is then left to end
    by itself (a daemon thread, so it never holds up the command's exit): a blocking
    client call cannot be interrupted, only no longer waited for."""
    outcome: list[Exception | None] = []

    def attempt() -> None:
        try:
            request()
        except Exception as exc:  # noqa: BLE001 - raised again in the caller
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=attempt, name="doctor-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        return False
    if outcome[0] is not None:
        raise outcome[0]
    return True


def _create_fix(url: str, kind: str) -> str:
    parsed = parse_destination(url)
    make = {
        "s3": f"aws s3 mb s3://{parsed.bucket}",
        "gs": f"gcloud storage buckets create gs://{parsed.bucket}",
        "az": f"az storage container create --name {parsed.bucket}",
    }.get(kind, "")
    return f"create it ({make}) or correct destination.url" if make else "correct destination.url"


__all__ = ["PROBE_DEADLINE_SECONDS", "PROBE_DIR", "DestinationChecks"]
