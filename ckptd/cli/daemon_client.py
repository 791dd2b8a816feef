"""Asking the running daemon over its control API (``ckptd status``, ``ckptd drill``).

Where: ``--url`` when given (``http://host:port`` or ``unix:/path``); else the control
listener (``http.listen``: by default the Unix socket under ``state.dir``) when this user
can reach it; else the scrape listener (``metrics.listen``), which serves the control API
only on loopback or with a token. The token (``http.token_file`` or ``http.token``) is
sent on TCP only, read from the same file the daemon reads; it is never printed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.cli.errors import DaemonUnreachableError
from ckptd.cli.invocation import settings_of
from ckptd.config import Settings
from ckptd.config.control import control_socket, control_tcp, read_token
from ckptd.runtime.socket_path import socket_address


@dataclass(frozen=True)
class Endpoint:
    """One way to reach the daemon: a Unix socket, or a TCP base URL with a token."""

    where: str  # what a message calls it: the URL or unix:PATH
    socket: Path | None = None
    host: str = ""
    port: int = 0
    token: str = ""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            with socket_address(self._path) as address:
                sock.connect(address)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def daemon_request(
    args: argparse.Namespace,
    path: str,
    *,
    failure: str,
    method: str = "GET",
    timeout: float = 5,
) -> tuple[str, Any]:
    """Where the daemon was reached and its JSON answer; DaemonUnreachableError
    ("<failure>: why") when it does not answer, refuses, or answers with something other
    than JSON."""
    settings = settings_of(args)
    endpoints = _endpoints(args, settings)
    last: str = ""
    for endpoint in endpoints:
        try:
            status, body = _ask(endpoint, path, method, timeout)
        except (OSError, http.client.HTTPException) as exc:
            last = f"{endpoint.where}: {exc}"
            continue  # the next way in, if any
        return endpoint.where, _answer(endpoint, status, body, failure, settings)
    raise DaemonUnreachableError(f"{failure}: daemon not reachable ({last})")


def _endpoints(args: argparse.Namespace, settings: Settings) -> list[Endpoint]:
    sock = control_socket(settings)
    if not args.url and sock is not None and os.access(sock, os.W_OK):
        # On the node, as the daemon's user or root: no token needed (nor read: this
        # user may not be allowed to read the token file).
        return [Endpoint(f"unix:{sock}", socket=sock)]
    token = read_token(settings.http)
    if args.url:
        url: str = args.url
        if url.startswith("unix:"):
            return [Endpoint(url, socket=Path(url[5:]))]
        return [_tcp(url, token)]
    found: list[Endpoint] = []
    tcp = control_tcp(settings)
    if tcp is not None:
        found.append(_tcp(f"http://{url_host(tcp[0])}:{tcp[1]}", token))
    metrics = settings.metrics
    found.append(_tcp(f"http://{url_host(metrics.host)}:{metrics.port}", token))
    return found


def _tcp(url: str, token: str) -> Endpoint:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise DaemonUnreachableError(f"--url {url!r}: give http://host:port or unix:/path")
    return Endpoint(url.rstrip("/"), host=parts.hostname, port=parts.port or 80, token=token)


def _ask(endpoint: Endpoint, path: str, method: str, timeout: float) -> tuple[int, bytes]:
    conn: http.client.HTTPConnection
    if endpoint.socket is not None:
        conn = _UnixConnection(endpoint.socket, timeout)
    else:
        conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
    headers = {"Authorization": f"Bearer {endpoint.token}"} if endpoint.token else {}
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _answer(endpoint: Endpoint, status: int, body: bytes, failure: str, settings: Settings) -> Any:
    where = endpoint.where
    if status == 401:
        if endpoint.token:
            why = "refused the token it was given"
        else:
            why = "asks for a token and none is configured"
        raise DaemonUnreachableError(
            f"{failure}: the daemon at {where} answered but {why} (HTTP 401); use the "
            "token file the daemon reads (http.token_file, readable by this user), or run "
            f"on the node, where the control socket ({control_socket(settings)}) needs none"
        )
    if status == 404 and endpoint.socket is None:
        raise DaemonUnreachableError(
            f"{failure}: the daemon at {where} answered but does not serve the control API "
            "there (no token configured); run on the node, as the daemon's user or root "
            f"(control socket {control_socket(settings)}), or configure http.token_file"
        )
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if status >= 400 or doc is None:
        detail = doc.get("error") if isinstance(doc, dict) else body[:200].decode(errors="replace")
        raise DaemonUnreachableError(
            f"{failure}: the daemon at {where} answered HTTP {status}: {detail}"
        )
    return doc


def url_host(host: str) -> str:
    """The host to dial for a daemon listening on ``host`` (a wildcard: this machine)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
