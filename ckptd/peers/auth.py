"""Every peer request is signed with the cluster's token, and so is every acknowledgement.

Pure: HMAC-SHA-256 over the request, with the time passed in; no I/O, no clock.

The token (``[peers] token_file``, the same file on every node of the cluster) never
crosses the network: a request carries

    Authorization: ckptd-peer 1:<unix seconds>:<nonce, 32 hex>:<mac, 64 hex>
    mac = HMAC-SHA-256(token, "ckptd.peer.request/1\\n" METHOD "\\n" PATH?QUERY "\\n"
                              SECONDS "\\n" NONCE "\\n" BODY)

where BODY is ``sha256:<hex>`` of a JSON body, ``crc32c:<hex>`` of a chunk (the value its
``X-Ckptd-Crc32c`` header carries and the holder checks every byte against), or empty.
The holder refuses (401) a request without one, with a bad mac, more than
``WINDOW_SECONDS`` away from its own clock, or whose nonce it saw within the window (a
replay). So without the token a client can neither write nor read, and one that
watches the wire learns no token.

A seal's answer names the replica it acknowledges and carries
``HMAC(token, "ckptd.peer.ack/1\\n" NONCE "\\n" REPLICA_ID)`` for the request's nonce: the
origin counts a part safe only on an acknowledgement only a holder of the token could
have made, for this request, of this exact content.

Chunks are held to their CRC-32C, which a deliberate forger can match; with
``[authentication]`` every file's BLAKE3 digest is also checked before the seal is
acknowledged, and the replica's own document (which names them) is under the mac.
Confidentiality is not this module's: the bytes cross the cluster network in clear
(docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from typing import Any

SCHEME = "ckptd-peer"
VERSION = "1"
REQUEST_DOMAIN = b"ckptd.peer.request/1\n"
ACK_DOMAIN = b"ckptd.peer.ack/1\n"
#: A request signed further than this from the holder's clock is refused.
WINDOW_SECONDS = 300.0
#: Nonces remembered (a replay within the window is refused); the oldest go first.
NONCES_KEPT = 65536
MIN_TOKEN_BYTES = 16


def check_token(token: bytes) -> str | None:
    """Why ``token`` cannot sign peer requests, or None."""
    if len(token) < MIN_TOKEN_BYTES:
        return f"it holds {len(token)} bytes; use at least {MIN_TOKEN_BYTES} (openssl rand -hex 32)"
    if any(c in b" \t\r\n" for c in token):
        return "it holds whitespace inside the token"
    return None


def body_sha256(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def body_crc32c(crc_hex: str) -> str:
    return "crc32c:" + crc_hex


def _mac(token: bytes, method: str, target: str, seconds: int, nonce: str, body: str) -> str:
    message = b"\n".join(s.encode() for s in (method.upper(), target, str(seconds), nonce, body))
    return hmac.new(token, REQUEST_DOMAIN + message, hashlib.sha256).hexdigest()


def sign(token: bytes, method: str, target: str, now: float, body: str = "") -> tuple[str, str]:
    """The ``Authorization`` value for a request of ``method`` to ``target`` (path and
    query, as sent), and its nonce (to check the acknowledgement against)."""
    seconds = int(now)
    nonce = secrets.token_hex(16)
    mac = _mac(token, method, target, seconds, nonce, body)
    return f"{SCHEME} {VERSION}:{seconds}:{nonce}:{mac}", nonce


class RequestChecker:
    """The holder's side: checks each request's signature, remembering nonces. Thread-safe
    when given a lock (the peer server passes one: HTTP requests on the event loop and
    stream frames in threads share one checker); this module itself stays pure."""

    def __init__(
        self,
        token: bytes,
        window: float = WINDOW_SECONDS,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        self.token = token
        self.window = window
        self._nonces: OrderedDict[str, float] = OrderedDict()
        self._lock: AbstractContextManager[Any] = lock if lock is not None else nullcontext()

    def check(
        self, header: str | None, method: str, target: str, now: float, body: str = ""
    ) -> tuple[str | None, str]:
        """``(why refused or None, nonce)``."""
        if not header:
            return "no Authorization header", ""
        scheme, _, rest = header.partition(" ")
        fields = rest.split(":")
        if scheme != SCHEME or len(fields) != 4 or fields[0] != VERSION:
            return "not a ckptd-peer signature", ""
        _, seconds_text, nonce, mac = fields
        try:
            seconds = int(seconds_text)
        except ValueError:
            return "a malformed time", ""
        expected = _mac(self.token, method, target, seconds, nonce, body)
        if not hmac.compare_digest(expected, mac):
            return "a wrong signature (another token, or the request was altered)", ""
        if abs(now - seconds) > self.window:
            return f"signed {now - seconds:+.0f} s from this node's clock", ""
        with self._lock:
            self._forget(now)
            if nonce in self._nonces:
                return "a replayed request", ""
            self._nonces[nonce] = now
        return None, nonce

    def _forget(self, now: float) -> None:
        while self._nonces and (
            len(self._nonces) >= NONCES_KEPT
            or next(iter(self._nonces.values())) < now - 2 * self.window
        ):
            self._nonces.popitem(last=False)


def ack(token: bytes, nonce: str, replica: str) -> str:
    """The holder's proof that it sealed ``replica`` for the request with ``nonce``."""
    message = ACK_DOMAIN + f"{nonce}\n{replica}".encode()
    return hmac.new(token, message, hashlib.sha256).hexdigest()


def ack_holds(token: bytes, nonce: str, replica: str, proof: str) -> bool:
    return hmac.compare_digest(ack(token, nonce, replica), proof)


__all__ = [
    "NONCES_KEPT",
    "SCHEME",
    "WINDOW_SECONDS",
    "RequestChecker",
    "ack",
    "ack_holds",
    "body_crc32c",
    "body_sha256",
    "check_token",
    "sign",
]
