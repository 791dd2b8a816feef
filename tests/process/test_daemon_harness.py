"""The daemon harness (tests/support/daemon.py) starts the daemon it was asked to start.

A CI run once failed a test that read another test's daemon: its port, free a moment
before, was taken by a daemon of the pytest that runs beside the rest, and the harness
took that one's ``/healthz`` for its own.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon


class _Healthy(http.server.BaseHTTPRequestHandler):
    """Another program on the port: it answers every GET 200, as another daemon would."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def held_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _daemon(tmp_path: Path, port: int, **extra: object) -> Daemon:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": run, "layout": "marker", "settle_seconds": 0}],
        dest=f"file://{tmp_path / 'store'}",
        state_dir=tmp_path / "state",
        **extra,
    )
    text = daemon.config.read_text().replace(f':{daemon.port}"', f':{port}"')
    daemon.config.write_text(text)
    daemon.port = port
    return daemon


def test_a_port_another_server_holds_moves_the_daemon_to_a_fresh_one(
    tmp_path: Path, held_port: int
) -> None:
    with _daemon(tmp_path, held_port) as daemon:
        assert daemon.port != held_port
        assert f':{daemon.port}"' in daemon.config.read_text()
        # What answers now is this daemon: its own metrics, its own status.
        assert any(name.startswith("ckptd_") for name, _ in daemon.metrics())
        assert daemon.events_named("http_listening", port=daemon.port)
        assert daemon.alive()
    first_log = daemon.log_text()
    assert "metrics.listen" in first_log and "cannot listen" in first_log


def test_a_daemon_that_exits_for_another_reason_fails_the_start_with_its_code_and_log(
    tmp_path: Path,
) -> None:
    daemon = _daemon(tmp_path, 0, concurrency=-3)
    with pytest.raises(AssertionError) as failed:
        daemon.start()
    assert "daemon exited 2" in str(failed.value)
    assert "destination.concurrency" in str(failed.value)
    assert not daemon.alive()
