"""``ckptd doctor`` against an endpoint that accepts connections and never answers (a
wrong port, a proxy or firewall that holds them): the real command, as a user runs it,
fails the destination within its deadline and says what it waited for, instead of
waiting out the S3 client's two 60 s read timeouts (121 s before this was bounded). The
deadline is doctor's own, not the client's: a gs:// destination, whose client keeps its
60 s, is bounded alike."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.config import DestinationConfig
from ckptd.doctor.store import PROBE_DEADLINE_SECONDS, DestinationChecks
from tests.support.daemon import run_cli


@pytest.fixture
def silent_endpoint() -> Iterator[tuple[str, list[socket.socket]]]:
    """``http://127.0.0.1:PORT`` where a loopback server accepts every connection and
    never reads nor writes a byte; yields it with the connections accepted so far."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)  # a closed socket does not wake a blocked accept(): poll
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted.append(conn)  # held open, never answered

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        done.set()
        thread.join(5)
        server.close()
        for conn in accepted:
            conn.close()


def test_doctor_on_an_endpoint_that_never_answers_fails_within_its_deadline_saying_so(
    tmp_path: Path, silent_endpoint: tuple[str, list[socket.socket]]
) -> None:
    endpoint, accepted = silent_endpoint
    watch = tmp_path / "run1"
    watch.mkdir()
    config = tmp_path / "ckptd.toml"
    config.write_text(
        f'[[watch]]\ndir = "{watch}"\n'
        f'[destination]\nurl = "s3://ckpt/p"\nendpoint_url = "{endpoint}"\n'
        '[preemption]\nprovider = "none"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n'
    )
    # Credentials of any kind: without them the client refuses before it connects.
    env = {"AWS_ACCESS_KEY_ID": "doctor", "AWS_SECRET_ACCESS_KEY": "doctor-secret"}
    started = time.monotonic()
    result = run_cli("doctor", config=config, env=env, timeout=60)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert accepted, "doctor never connected to the endpoint"
    # It waited its deadline for the store (not refused at once), and not much longer:
    # the command's start-up and its other checks take a few seconds even on a loaded
    # machine (about 2 s here), against the 121 s this took unbounded.
    assert PROBE_DEADLINE_SECONDS <= took < 30, (took, result.stdout)
    lines = result.stdout.splitlines()
    (fail,) = [ln for ln in lines if ln.startswith("fail")]
    assert fail.startswith(
        f"fail  destination  s3://ckpt/p: no answer from {endpoint} within 10 s"
    ), fail
    assert "; fix: check destination.endpoint_url" in fail, fail
    skipped = [ln.split()[1] for ln in lines if ln.startswith("skip")]
    assert skipped == ["credentials", "checksums", "clock", "create-only"], lines


def test_the_deadline_bounds_a_gs_destination_whose_client_waits_longer(
    silent_endpoint: tuple[str, list[socket.socket]],
) -> None:
    pytest.importorskip("google.cloud.storage")
    endpoint, accepted = silent_endpoint
    started = time.monotonic()
    findings = DestinationChecks(DestinationConfig(url="gs://ckpt/p", endpoint_url=endpoint)).run()
    took = time.monotonic() - started
    assert accepted, "doctor never connected to the endpoint"
    assert PROBE_DEADLINE_SECONDS <= took < PROBE_DEADLINE_SECONDS + 5, took
    lines = [f.line() for f in findings]
    assert [f.status for f in findings] == ["skip", "fail", "skip", "skip", "skip"], lines
    assert lines[1].startswith(
        f"fail  destination  gs://ckpt/p: no answer from {endpoint} within 10 s"
    ), lines
