"""Where the control API listens and which token guards it, resolved the same way by the
daemon (to serve) and by the CLI (to ask).

The token is read from ``http.token_file`` at the moment it is needed, never carried on a
command line or in an environment variable the CLI sets; under systemd a credential of
the same file name in ``$CREDENTIALS_DIRECTORY`` (``LoadCredential=``) is read in its
place, so the unit's user needs no access to the file itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ckptd.config.base import parse_listen
from ckptd.config.errors import ConfigError
from ckptd.config.node import CONTROL_SOCKET_NAME, HttpConfig
from ckptd.config.settings import Settings

__all__ = [
    "control_socket",
    "control_tcp",
    "exposed_bits",
    "meaning_changes",
    "read_token",
    "token_exposure",
    "token_source",
]


def control_socket(settings: Settings) -> Path | None:
    """The control API's Unix socket (None: it listens on TCP, ``control_tcp``)."""
    listen = settings.http.listen
    if not listen:
        return settings.state.dir / CONTROL_SOCKET_NAME
    return Path(listen[5:]) if listen.startswith("unix:") else None


def control_tcp(settings: Settings) -> tuple[str, int] | None:
    """(host, port) of a TCP control listener (None: a Unix socket)."""
    listen = settings.http.listen
    return parse_listen(listen) if listen and not listen.startswith("unix:") else None


def token_source(http: HttpConfig, environ: Mapping[str, str] | None = None) -> Path | None:
    """The file the token is read from: the systemd credential of the same name when
    there is one, else ``token_file`` (None: no token file)."""
    if not http.token_file:
        return None
    environ = os.environ if environ is None else environ
    credentials = environ.get("CREDENTIALS_DIRECTORY", "")
    if credentials:
        credential = Path(credentials) / Path(http.token_file).name
        if credential.is_file():
            return credential
    return Path(http.token_file)


def exposed_bits(mode: int, owned_by_reader: bool) -> int:
    """The permission bits by which someone other than the daemon may read a token file
    of ``mode`` (0: none), judged as ssh judges a private key: a file the reader owns must
    give group and others nothing (``mode & 0o077``); one it reads through its group (a
    Kubernetes Secret under ``fsGroup``: root's, group-readable) must give others nothing."""
    return mode & (0o077 if owned_by_reader else 0o007)


def token_exposure(http: HttpConfig, environ: Mapping[str, str] | None = None) -> str:
    """A line saying the token file is readable by others and the fix ("" when it is not,
    or there is no token file, or it cannot be read: ``read_token`` says that). ``ckptd
    doctor`` fails on it; the daemon warns at start-up."""
    source = token_source(http, environ)
    if source is None:
        return ""
    try:
        st = source.stat()
    except OSError:
        return ""
    bits = exposed_bits(st.st_mode, st.st_uid == os.geteuid())
    if not bits:
        return ""
    who = (
        "group and others"
        if bits & 0o070 and bits & 0o007
        else "group"
        if bits & 0o070
        else "others"
    )
    return (
        f"the token file {source} is readable by {who} (mode {st.st_mode & 0o777:04o}): "
        f"anyone who reads it can stop training; chmod 600 {source}"
    )


def read_token(http: HttpConfig, environ: Mapping[str, str] | None = None) -> str:
    """The bearer token ("" when none is configured); ConfigError (exit 2) naming
    ``http.token_file`` when the file cannot be read or holds no token."""
    source = token_source(http, environ)
    if source is None:
        return http.token.get_secret_value()
    try:
        token = source.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            "http.token_file",
            f"cannot read {source} ({why}): mount the token there (a Kubernetes Secret, "
            "a systemd LoadCredential=) or run as a user who may read it",
        ) from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(
            "http.token_file",
            f"{source} holds no token (it must hold one line with no spaces)",
        )
    return token


def meaning_changes(settings: Settings) -> list[str]:
    """One line for each setting whose meaning changed when the control API moved off
    the scrape listener (``ckptd config check`` prints them)."""
    metrics = settings.metrics
    if settings.http.has_token:
        # The control API stays on the scrape listener, behind the token, as before; only
        # the preemption state left it (a trainer must read it without the token).
        return [
            "GET /v1/preemption no longer needs the http token (it says only whether a "
            "notice is active, and its deadline); /v1/status, /v1/drill and /v1/advice "
            "still do"
        ]
    if metrics.loopback:
        return []  # the scrape listener serves the control API as before
    where = settings.http.listen or f"unix:{control_socket(settings)}"
    return [
        f"metrics.listen = {metrics.listen} now serves only /metrics, /healthz, /readyz "
        f"and /v1/preemption; /v1/status, /v1/drill and /v1/advice moved to http.listen "
        f"({where}), where `ckptd status` and `ckptd drill` find them"
    ]
