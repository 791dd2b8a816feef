"""Asking the running daemon over its HTTP API (``ckptd status``, ``ckptd drill``)."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from ckptd.cli.errors import DaemonUnreachableError
from ckptd.cli.invocation import settings_of


def daemon_request(
    args: argparse.Namespace,
    path: str,
    *,
    failure: str,
    method: str = "GET",
    timeout: float = 5,
) -> tuple[str, Any]:
    """The daemon's base URL and its JSON answer; DaemonUnreachableError ("<failure>: why")
    when it does not answer, refuses, or answers with something other than JSON."""
    settings = settings_of(args)
    base = args.url or f"http://{url_host(settings.metrics.host)}:{settings.metrics.port}"
    try:
        request = urllib.request.Request(f"{base}{path}", method=method)
        token = settings.http.token.get_secret_value()
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return base, json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DaemonUnreachableError(f"{failure}: {exc}") from exc


def url_host(host: str) -> str:
    """The host to dial for a daemon listening on ``host`` (a wildcard: this machine)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
