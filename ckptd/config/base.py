"""What the section models stand on: their frozen base and the value checks they share.

Each check raises ``ValueError`` saying what is wrong; pydantic reports it under the key
being validated, and ``ckptd.config.translation`` turns it into one line.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

from ckptd.core.signing import KeyFileError, load_key

__all__ = [
    "TIER_NAME",
    "Section",
    "absolute_path",
    "check_http_url",
    "check_key_file",
    "parse_duration",
    "parse_listen",
    "run_id_problem",
]


class Section(BaseModel):
    """One ``[section]`` of the configuration file."""

    # Frozen: one validated Settings is shared by every task of the daemon; a change of
    # configuration goes through load_settings (overrides), never through assignment.
    model_config = ConfigDict(extra="forbid", frozen=True)


TIER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
_RUN_ID_CHARS = re.compile(r"[A-Za-z0-9._=-]+")
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*")
_PORT = re.compile(r"[0-9]{1,5}")


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a remote namespace, or None when it can."""
    # The run id becomes one path segment of every remote key (and, for file://, of a real
    # path), so it must not be able to climb out of or collapse into its parent.
    if not run_id:
        return "must not be empty"
    if not _RUN_ID_CHARS.fullmatch(run_id):
        return "may contain only letters, digits and . _ = -"
    if run_id == "." or ".." in run_id:
        return "must not be '.' or contain '..'"
    return None


def absolute_path(path: Path) -> Path:
    """``path`` with ``~`` expanded; ValueError unless the result is absolute."""
    try:
        expanded = path.expanduser()
    except RuntimeError as exc:  # "~user" with no such user, or no HOME
        raise ValueError(f"cannot expand '~': {exc}") from None
    if not expanded.is_absolute():
        raise ValueError("must be an absolute path")
    return expanded


def check_http_url(url: str, *, allow_path: bool) -> None:
    """ValueError unless ``url`` is http(s)://host[:port], with a path if ``allow_path``."""
    shape = "http(s)://host[:port]" + ("[/path]" if allow_path else "")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"must be {shape} with a port 1..65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be {shape}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not hold credentials (they come from the AWS credential chain)")
    if port == 0:
        raise ValueError(f"must be {shape} with a port 1..65535")
    if parts.query or parts.fragment:
        raise ValueError(f"must be {shape}, without query or fragment")
    if not allow_path and parts.path not in ("", "/"):
        raise ValueError(f"must be {shape}, without a path")


def parse_listen(listen: str) -> tuple[str, int]:
    """(host, port) of a ``host:port`` / ``[ipv6]:port`` listen address; ValueError if bad."""
    if listen.startswith("["):
        host, sep, port = listen[1:].partition("]:")
        if not sep:
            raise ValueError("must be [ipv6]:port, e.g. [::1]:9464")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    else:
        host, sep, port = listen.rpartition(":")
        if not sep or not host:
            raise ValueError("must be host:port, e.g. 127.0.0.1:9464")
        if ":" in host:
            raise ValueError("must put an IPv6 address in brackets, e.g. [::1]:9464")
        if not _HOSTNAME.fullmatch(host):
            raise ValueError(f"host {host!r} is not a hostname or IPv4 address")
    if not _PORT.fullmatch(port) or int(port) > 65535:
        raise ValueError("port must be a number 0..65535")
    return host, int(port)


_DURATION = re.compile(r"(?P<amount>[0-9]+(?:\.[0-9]+)?)(?P<unit>[smhdw]?)")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit s, m, h, d or w ("7d", "12h",
    "90"); ValueError naming the accepted forms."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise ValueError(
            f"{text!r} is not a duration: write a number and a unit s, m, h, d or w "
            '(e.g. "7d", "12h", "30m"), or "0" for off'
        )
    return float(match["amount"]) * _DURATION_UNITS[match["unit"]]


def check_key_file(value: str) -> None:
    """ValueError unless ``value`` is an absolute path to a usable signing key."""
    if not Path(value).is_absolute():
        raise ValueError(f"must be an absolute path, got {value!r}")
    try:
        load_key(value)
    except KeyFileError as exc:
        raise ValueError(str(exc)) from None
