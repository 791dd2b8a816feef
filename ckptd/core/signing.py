"""Authenticated checkpoints: the keys, signing a manifest, and checking one.

With ``[authentication] key_file`` set, every manifest carries each file's digest
(``ckptd.core.digest``), the id of the key that signed it, and an HMAC-SHA-256 over its
canonical form (``ckptd.core.manifest.signable_bytes``). ``verify`` and ``restore`` then
refuse a manifest that is unsigned, signed with a key they do not hold, or whose
signature does not match; the bytes are held to the digests as they are read.

Keys live in files, never in the TOML, logs, status or errors: only a key's id (the
first 8 hex digits of the SHA-256 of the key, so it can never be paired with the wrong
key) is ever shown. A key file holds at least 32 bytes (leading and trailing whitespace
is ignored, so ``openssl rand -hex 32 > FILE`` makes one). Rotation: sign with the new
key, list the old ones in ``verify_key_files``; they verify, and never sign.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core import digest
from ckptd.core.errors import EXIT_USAGE, CkptdError
from ckptd.core.manifest import Manifest, ManifestError, signable_bytes

MIN_KEY_BYTES = 32


class KeyFileError(CkptdError, ValueError):
    """A key file that cannot be used (exit 2, a configuration problem); the message
    names the file, never its content."""

    exit_code = EXIT_USAGE


class AuthenticationError(ManifestError):
    """A manifest that authentication refuses (exit 1); the message says why."""


def load_key(path: str | Path) -> bytes:
    """The key in ``path``; KeyFileError if it cannot be read or is too short."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {str(path)!r}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise KeyFileError(
            f"key file {str(path)!r} holds {len(key)} bytes, a key needs at least "
            f"{MIN_KEY_BYTES}: make one with `openssl rand -hex 32 > {path}`"
        )
    return key


def key_id_of(key: bytes) -> str:
    """A key's public name: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(key).hexdigest()[:8]


@dataclass(frozen=True)
class KeyRing:
    """The signing key and every key accepted for verification (the signing key too)."""

    signing_id: str
    _keys: dict[str, bytes] = field(repr=False)

    @classmethod
    def from_files(
        cls, key_file: str | Path, verify_key_files: Sequence[str | Path] = ()
    ) -> KeyRing:
        signing = load_key(key_file)
        keys = {key_id_of(signing): signing}
        for path in verify_key_files:
            key = load_key(path)
            keys.setdefault(key_id_of(key), key)
        return cls(key_id_of(signing), keys)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def _mac(self, key: bytes, manifest: Manifest) -> str:
        return hmac.new(key, signable_bytes(manifest), hashlib.sha256).hexdigest()

    def sign(self, manifest: Manifest) -> Manifest:
        """``manifest`` with the digest algorithm, key id and signature set; every file
        must carry its digest (ManifestError otherwise: nothing unsigned is committed)."""
        bare = [f.path for f in manifest.files if not f.digest]
        if bare:
            raise ManifestError(
                f"{manifest.run_id}/{manifest.checkpoint}: no digest for {bare[0]!r}"
                + (f" and {len(bare) - 1} more" if len(bare) > 1 else "")
                + ": every node needs [authentication] key_file"
            )
        unsigned = manifest.model_copy(
            update={"digest": digest.ALGORITHM, "key_id": self.signing_id, "signature": None}
        )
        signature = self._mac(self._keys[self.signing_id], unsigned)
        return unsigned.model_copy(update={"signature": signature})

    def check(self, manifest: Manifest) -> None:
        """Raise AuthenticationError unless ``manifest`` is signed by a key held here,
        its signature holds, and it gives every file a digest of the known algorithm."""
        where = f"{manifest.run_id}/{manifest.checkpoint}"
        if not manifest.signature or not manifest.key_id:
            raise AuthenticationError(
                f"{where} is not signed, and [authentication] requires a signed manifest"
            )
        key = self._keys.get(manifest.key_id)
        if key is None:
            raise AuthenticationError(
                f"{where} is signed with unknown key id {manifest.key_id!r} (this node holds "
                f"{', '.join(self.key_ids)}): add that key to authentication.verify_key_files"
            )
        if not hmac.compare_digest(self._mac(key, manifest), manifest.signature):
            raise AuthenticationError(
                f"{where}: manifest signature does not match (key id {manifest.key_id}): "
                "the manifest was altered"
            )
        # Signed, so written by a key holder: these would be a ckptd bug, not tampering.
        if manifest.digest != digest.ALGORITHM or any(not f.digest for f in manifest.files):
            raise AuthenticationError(
                f"{where}: signed, but digest {manifest.digest!r} is not {digest.ALGORITHM!r} "
                "for every file"
            )


__all__ = [
    "AuthenticationError",
    "KeyFileError",
    "KeyRing",
    "key_id_of",
    "load_key",
]
