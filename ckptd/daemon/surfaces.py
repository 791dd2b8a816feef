"""Starting the two HTTP surfaces (``ckptd.daemon.http``): the scrape listener on
``metrics.listen``, with the control API only on loopback or with a token, and the
control listener on ``http.listen`` (by default the Unix socket under ``state.dir``).
A listener that cannot be opened is a config error naming its key (exit 2)."""

from __future__ import annotations

from typing import Any, Protocol

from ckptd.config import ConfigError, Settings
from ckptd.config.control import (
    control_socket,
    control_tcp,
    read_token,
    token_exposure,
    token_source,
)
from ckptd.daemon.http import HttpServer


class Served(Protocol):
    """What the surfaces read at request time (the service)."""

    responder: Any
    advisor: Any
    metrics: Any
    drills: Any

    def status(self) -> dict[str, Any]: ...

    def ready(self) -> tuple[bool, dict[str, Any]]: ...


async def start_surfaces(
    daemon: Served, settings: Settings, log: Any
) -> tuple[HttpServer, HttpServer]:
    """(scrape, control), both listening."""
    token = read_token(settings.http)
    exposure = token_exposure(settings.http)
    if exposure:  # as ssh warns of a private key others can read (ckptd doctor fails)
        source = token_source(settings.http)
        log.warning(
            "token_file_readable", file=str(source), why=exposure, fix=f"chmod 600 {source}"
        )

    def server(*, control: bool, token: str = token) -> HttpServer:
        return HttpServer(
            daemon.metrics,
            status=daemon.status,
            ready=daemon.ready,
            preemption=daemon.responder.preemption_json,
            advice=daemon.advisor.advice_json,
            drill=daemon.drills.drill,
            token=token,
            control=control,
        )

    scrape_at = settings.metrics
    scrape = server(control=scrape_at.loopback or bool(token))
    port = await _listen(scrape, "metrics.listen", scrape_at.host, scrape_at.port)
    log.info("http_listening", host=scrape_at.host, port=port, control_api=scrape.control)
    socket = control_socket(settings)
    # The socket's file mode guards it (0600); a TCP control listener has the token.
    control = server(control=True, token="" if socket is not None else token)
    if socket is not None:
        try:
            await control.start_unix(socket)
        except OSError as exc:
            raise ConfigError(
                "http.listen",
                f"cannot listen on the Unix socket {socket} ({exc.strerror or exc}); "
                "set http.listen = unix:/another/path or a loopback host:port",
            ) from None
        log.info("control_listening", socket=str(socket))
    else:
        host, wanted = control_tcp(settings) or ("127.0.0.1", 0)
        bound = await _listen(control, "http.listen", host, wanted)
        log.info("control_listening", host=host, port=bound)
    return scrape, control


async def _listen(server: HttpServer, key: str, host: str, port: int) -> int:
    """``server`` on ``host:port``; a port taken is a config error naming ``key``."""
    try:
        return await server.start(host, port)
    except OSError as exc:
        env = "CKPTD_" + key.upper().replace(".", "__")
        raise ConfigError(
            key,
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); another ckptd or "
            f"program may hold it: choose a free port ({key}, {env}; port 0 = any)",
        ) from None
