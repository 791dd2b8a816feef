"""S3 failures, botocore's and the direct path's (``s3_direct``), classified once: what a
later attempt may fix, what it never will, and what says the destination as configured
can never work (``storage.base``'s error contract)."""

from __future__ import annotations

from http.client import HTTPException

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from ckptd.storage.base import NotFoundError, PreconditionFailedError, StorageError

# S3 error codes a later attempt may fix (AWS S3 error responses; throttling from
# botocore's retry handler list).
TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "OperationAborted",
    # The store computed a different checksum of the body than ckptd did from the same
    # buffer: the bytes were damaged in transit, so sending them again is the fix.
    "BadDigest",
    "InvalidDigest",
    "XAmzContentSHA256Mismatch",
    "500",
    "502",
    "503",
    "504",
}
NOT_FOUND_CODES = {"NoSuchKey", "NoSuchUpload", "404", "NotFound"}
# Codes that say the destination as configured can never work (no such bucket, no
# access, credentials missing or wrong), whichever operation met them.
UNUSABLE_CODES = {
    "NoSuchBucket",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NoCredentials",
}


# The store refuses these credentials for this bucket: the same plain words whichever
# command met them (``S3Storage.check`` says them of a HEAD, which carries no code).
CREDENTIAL_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
FIX_BUCKET = "fix: create it, or correct the destination URL"
CHECK_CREDENTIALS = (
    "check the credentials boto3 found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
    "AWS_PROFILE, or the instance or task role)"
)


def classify(exc: Exception, what: str) -> StorageError:
    """Turn a botocore failure into a StorageError that says whether to retry."""
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return classify_reply(status, str(err.get("Code", "")), str(err.get("Message", "")), what)
    if isinstance(exc, HTTPException):
        # A reply the direct path could not read (cut short, malformed): as a reset.
        return StorageError(f"{what}: {exc!r}", transient=True, code=type(exc).__name__)
    if isinstance(
        exc,
        EndpointConnectionError | ConnectionClosedError | ReadTimeoutError | ConnectTimeoutError,
    ):
        return StorageError(f"{what}: {exc}", transient=True, code=type(exc).__name__)
    if isinstance(exc, NoCredentialsError):
        return StorageError(
            f"{what}: no S3 credentials found; boto3 looks in AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, then AWS_PROFILE / ~/.aws/credentials and ~/.aws/config, "
            "then web identity and the instance or task role: set one of those",
            transient=False,
            code="NoCredentials",
            destination_unusable=True,
        )
    if isinstance(exc, BotoCoreError | ConnectionError | TimeoutError | OSError):
        # Resets and broken pipes below botocore's own wrappers.
        return StorageError(f"{what}: {exc}", transient=True, code=type(exc).__name__)
    return StorageError(f"{what}: {exc!r}", transient=False, code=type(exc).__name__)


def classify_reply(status: int, code: str, message: str, what: str) -> StorageError:
    """An S3 error reply (its HTTP status, S3 error code and message) as a StorageError
    that says whether to retry: botocore's replies and the direct path's alike."""
    text = f"{what}: {code or status} {message}".strip()
    if code in ("PreconditionFailed", "412") or status == 412:
        return PreconditionFailedError(text)
    if code == "NoSuchBucket":
        return StorageError(
            f"{what}: the bucket does not exist (NoSuchBucket); {FIX_BUCKET}",
            transient=False,
            code=code,
            destination_unusable=True,
        )
    if code in CREDENTIAL_CODES:
        return StorageError(
            f"{what}: access denied ({code}): {CHECK_CREDENTIALS}",
            transient=False,
            code=code,
            destination_unusable=True,
        )
    if code in NOT_FOUND_CODES or (status == 404 and not code):
        return NotFoundError(text, code=code or "404")
    transient = code in TRANSIENT_CODES or status >= 500 or status == 429
    return StorageError(
        text,
        transient=transient,
        code=code or str(status),
        destination_unusable=code in UNUSABLE_CODES,
    )
