"""AWS Signature Version 4 of a request head, as S3 checks it: enough for the fault proxy
to drop a header a client signed (``If-None-Match``) and sign the request again, so the
store behind it takes the request as the client sent it, less that header.

The recipe (https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html,
and botocore's ``S3SigV4Auth``): the canonical request is the method, the path as sent
(S3 does not normalise it), the query's pairs sorted, each signed header as
``name:value`` (whitespace runs folded), the signed header names, and the payload hash
the client stated in ``x-amz-content-sha256``; the string to sign adds the request's
``x-amz-date`` and the credential scope; the key is derived from the secret by HMAC over
date, region, service and ``aws4_request``. Nothing of the body is read.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence

ALGORITHM = "AWS4-HMAC-SHA256"
_AUTHORIZATION = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<scope>[^,]+),\s*"
    r"SignedHeaders=(?P<signed>[^,]+),\s*Signature=(?P<signature>[0-9a-f]+)"
)


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _canonical_query(query: str) -> str:
    pairs = [pair.partition("=") for pair in query.split("&") if pair]
    return "&".join(f"{k}={v}" for k, _, v in sorted(pairs))


def sign(
    method: str,
    target: str,
    headers: Sequence[tuple[str, str]],
    *,
    signed: Sequence[str],
    access_key: str,
    secret_key: str,
    scope: str,
) -> str:
    """The ``Authorization`` value for a request with ``headers`` (names lower-cased),
    signing the header names ``signed`` under ``scope`` (``DATE/REGION/SERVICE/aws4_request``)."""
    path, _, query = target.partition("?")
    values: dict[str, list[str]] = {}
    for name, value in headers:
        values.setdefault(name, []).append(" ".join(value.split()))
    names = sorted(set(signed))
    canonical = "\n".join(
        [
            method.upper(),
            path,
            _canonical_query(query),
            "".join(f"{n}:{','.join(values.get(n, []))}\n" for n in names),
            ";".join(names),
            values["x-amz-content-sha256"][0],
        ]
    )
    amz_date = values["x-amz-date"][0]
    to_sign = "\n".join(
        [ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = ("AWS4" + secret_key).encode()
    for part in scope.split("/"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"{ALGORITHM} Credential={access_key}/{scope}, SignedHeaders={';'.join(names)}, Signature={signature}"


def resign_without(
    method: str,
    target: str,
    headers: Sequence[tuple[str, str]],
    drop: str,
    *,
    access_key: str,
    secret_key: str,
) -> list[tuple[str, str]]:
    """``headers`` less every ``drop`` header, with an ``Authorization`` that signs what
    is left as the client signed it (same scope, same other headers). ValueError when the
    request carries no SigV4 ``Authorization`` header of ``access_key``."""
    drop = drop.lower()
    auth = next((v for k, v in headers if k == "authorization"), "")
    found = _AUTHORIZATION.fullmatch(auth.strip())
    if found is None or found["key"] != access_key:
        raise ValueError(f"not a SigV4 request of {access_key!r}: {auth[:60]!r}")
    kept = [(k, v) for k, v in headers if k not in (drop, "authorization")]
    signed = [n for n in found["signed"].split(";") if n != drop]
    authorization = sign(
        method,
        target,
        kept,
        signed=signed,
        access_key=access_key,
        secret_key=secret_key,
        scope=found["scope"],
    )
    return [*kept, ("authorization", authorization)]


__all__ = ["resign_without", "sign"]
