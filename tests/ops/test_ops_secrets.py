"""Secrets never leak: S3 credentials and the HTTP bearer token appear in no log line,
no HTTP answer and no CLI output, on the happy path and on the error paths.

A SeaweedFS of its own accepts a distinctive secret key, so a real commit is made with
it; a session token (which SeaweedFS refuses) drives the destination-error path.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.devtools import locals3
from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.ops import hf_daemon
from tests.support.writers import write_hf

SECRET_KEY = f"ckptdCanarySecret{uuid.uuid4().hex}"
SESSION_TOKEN = f"ckptdCanarySession{uuid.uuid4().hex}"
HTTP_TOKEN = f"ckptdCanaryToken{uuid.uuid4().hex}"
CANARIES = (SECRET_KEY, SESSION_TOKEN, HTTP_TOKEN)


def assert_no_secret(where: str, text: str) -> None:
    for canary in CANARIES:
        # The whole value, and a long piece of it (a truncated or re-encoded echo).
        for piece in (canary, canary[-24:]):
            assert piece not in text, f"a secret leaked into {where}"


@pytest.fixture
def s3_with_canary_secret(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LocalS3]:
    """A SeaweedFS whose only identity's secret key is the canary."""
    monkeypatch.setattr(locals3, "SECRET_KEY", SECRET_KEY)
    # weed also takes an identity from AWS_* in its environment; make it the same one.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    server = LocalS3(tmp_path_factory.mktemp("seaweedfs-canary"), buckets=("ckpt",)).start()
    try:
        yield server
    finally:
        server.stop()


def _get(daemon: Daemon, path: str, token: str | None = HTTP_TOKEN) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{daemon.port}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _http_surface(daemon: Daemon) -> dict[str, str]:
    out = {}
    for path in ("/metrics", "/healthz", "/readyz", "/v1/status", "/v1/preemption"):
        _status, body = _get(daemon, path)
        out[path] = body
    status, body = _get(daemon, "/v1/status", token="wrong")
    assert status == 401
    out["/v1/status (bad token)"] = body
    return out


def test_secrets_never_leak_from_a_committing_daemon(
    tmp_path: Path, s3_with_canary_secret: LocalS3
) -> None:
    env = {
        "AWS_ACCESS_KEY_ID": locals3.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "CKPTD_HTTP__TOKEN": HTTP_TOKEN,
    }
    daemon, root = hf_daemon(
        tmp_path,
        s3_with_canary_secret,
        "s3://ckpt/secrets",
        env=env,
        extra_args=["--log-level", "debug"],
    )
    with daemon:
        write_hf(root, 10)
        wait_until(
            lambda: daemon.metric("ckptd_checkpoints_committed_total", run="run1") >= 1,
            30,
            "commit with the canary secret",
        )
        surface = _http_surface(daemon)
        assert json.loads(surface["/v1/status"])["runs"]["run1"]["last_committed"]["step"] == 10
        status_env = {**env, "CKPTD_METRICS__LISTEN": f"127.0.0.1:{daemon.port}"}
        for args in (("status",), ("status", "--json")):
            result = run_cli(*args, "--config", str(daemon.config), env=status_env)
            assert result.returncode == 0, result.stderr
            surface[f"ckptd {' '.join(args)}"] = result.stdout + result.stderr
        assert daemon.stop() == 0
    check = run_cli("config", "check", "--config", str(daemon.config), env=env)
    assert check.returncode == 0, check.stderr
    assert 'token = "***"' in check.stdout
    surface["ckptd config check"] = check.stdout + check.stderr
    surface["daemon log"] = daemon.log_text()
    assert '"checkpoint_committed"' in surface["daemon log"]  # the log is the real one
    for where, text in surface.items():
        assert_no_secret(where, text)


def test_secrets_never_leak_when_the_destination_refuses_them(
    tmp_path: Path, s3_with_canary_secret: LocalS3
) -> None:
    """SeaweedFS refuses the session token: the errors logged and served name the
    problem, never the credentials."""
    env = {
        "AWS_ACCESS_KEY_ID": locals3.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_SESSION_TOKEN": SESSION_TOKEN,
        "CKPTD_HTTP__TOKEN": HTTP_TOKEN,
    }
    daemon, root = hf_daemon(
        tmp_path,
        s3_with_canary_secret,
        "s3://ckpt/refused",
        env=env,
        extra_args=["--log-level", "debug"],
    )
    with daemon:
        write_hf(root, 10)
        wait_until(lambda: daemon.events_named("destination_unusable"), 30, "the refusal")
        status, body = _get(daemon, "/readyz")
        assert status == 503 and json.loads(body)["destination_error"]
        surface = _http_surface(daemon)
        assert daemon.stop() == 0
    surface["daemon log"] = daemon.log_text()
    for where, text in surface.items():
        assert_no_secret(where, text)


def test_config_errors_never_echo_the_http_token(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(
        f'[http]\ntoken = "{HTTP_TOKEN}"\nbogus = "{HTTP_TOKEN}"\n'
        '[metrics]\nlisten = "not-an-address"\n'
    )
    env = {"AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_SESSION_TOKEN": SESSION_TOKEN}
    result = run_cli("config", "check", "--config", str(config), env=env)
    assert result.returncode == 2
    assert_no_secret("config check error", result.stdout + result.stderr)
    bad_env = {**env, "CKPTD_HTTP__TOKEN": HTTP_TOKEN, "CKPTD_HTTP__BOGUS": HTTP_TOKEN}
    result = run_cli("config", "check", env=bad_env)
    assert result.returncode == 2
    assert_no_secret("config check env error", result.stdout + result.stderr)
