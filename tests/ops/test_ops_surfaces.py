"""The two HTTP surfaces as shipped (issue #31): the scrape port any pod can reach
cannot stop training or read the store's status; the node's own `ckptd status` and
`ckptd drill` still work; a control listener that others can reach needs a token, read
from a file, that never shows.

The shipped configs are run as shipped, but for what this machine needs: the watch dir,
the store, the state dir and the port are swapped for the test's own, and no cloud is
asked for notices (provider = none). The trainer is compose's toy trainer (it saves on
SIGUSR1), named so that the shipped `trainer.match` finds it; beside it a bystander whose
command line also matches (a pager on the script) and which has no SIGUSR1 handler.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.runtime.processes import catches_signal
from tests.support.daemon import Daemon, run_cli, wait_until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
SHIPPED = {
    "daemonset": DEPLOY / "kubernetes" / "daemonset.yaml",
    "pod": DEPLOY / "kubernetes" / "pod.yaml",
    "compose": COMPOSE,
}
TOKEN = "t0k3n-" + "9f2c" * 8


def reachable_address() -> str:
    """An address of this machine other pods would use (not loopback) when there is one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
    return address if not address.startswith("127.") else "127.0.0.1"


def http(method: str, url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def dockerfile_env() -> dict[str, str]:
    """The ``ENV CKPTD_*`` of the Dockerfile (compose's image sets them)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for pair in line[4:].split():
                key, _, value = pair.partition("=")
                if key.startswith("CKPTD_"):
                    env[key] = value
    return env


def shipped_daemon(kind: str, tmp: Path, local_s3: LocalS3, dest: str) -> tuple[Daemon, Path, str]:
    """The daemon of ``kind`` as shipped (module doc), its watch dir, and its match."""
    root, state, port = tmp / "ckpt-run1", tmp / "state", free_port()
    root.mkdir()
    local = {
        "CKPTD_DESTINATION__URL": dest,
        "CKPTD_DESTINATION__ENDPOINT_URL": local_s3.endpoint_url,
        "CKPTD_STATE__DIR": str(state),
        "CKPTD_PREEMPTION__PROVIDER": "none",
    }
    config = tmp / "ckptd.toml"
    if kind == "compose":
        service = yaml.safe_load(COMPOSE.read_text())["services"]["ckptd"]
        env = {**dockerfile_env(), **{k: str(v) for k, v in service["environment"].items()}}
        env = {k: v for k, v in env.items() if k.startswith("CKPTD_")}
        args = [str(a) for a in service["command"]]
        args[args.index("--watch") + 1] = str(root)
        for flag in ("--dest", "--endpoint-url"):
            i = args.index(flag)
            del args[i : i + 2]
        config.write_text("")
        match = env["CKPTD_TRAINER__MATCH"]
    else:
        docs = [d for d in yaml.safe_load_all(SHIPPED[kind].read_text()) if d]
        (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
        text = configmap["data"]["ckptd.toml"]
        shipped = tomllib.loads(text)
        text = text.replace(json.dumps(shipped["watch"][0]["dir"]), json.dumps(str(root)))
        config.write_text(text)
        env, args, match = {}, [], shipped["trainer"]["match"]
    host = (
        env.get("CKPTD_METRICS__LISTEN") or tomllib.loads(config.read_text())["metrics"]["listen"]
    ).rsplit(":", 1)[0]
    assert host == "0.0.0.0", f"{kind} ships a scrape port others can reach"
    env.update(local, CKPTD_METRICS__LISTEN=f"{host}:{port}")
    daemon = Daemon(config, tmp / "daemon.log", port, extra_args=args, env=env)
    return daemon, root, match


@pytest.fixture
def trainer_and_bystander(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(root: Path, match: str) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
        script, _ = yaml.safe_load(COMPOSE.read_text())["services"]["trainer"]["command"]
        trainer = subprocess.Popen(
            [sys.executable, "-c", script, match],
            env={**os.environ, "CKPT_DIR": str(root)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        # A pager on the trainer's script: it matches, and SIGUSR1 would end it.
        bystander = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(300)", "less", match]
        )
        started.extend([trainer, bystander])
        wait_until(lambda: catches_signal(trainer.pid, signal.SIGUSR1), 30, "trainer handler")
        return trainer, bystander

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("kind", list(SHIPPED))
def test_shipped_scrape_port_cannot_stop_training_and_the_node_still_can(
    kind: str, tmp_path: Path, local_s3: LocalS3, s3_dest: str, trainer_and_bystander: Any
) -> None:
    daemon, root, match = shipped_daemon(kind, tmp_path, local_s3, s3_dest)
    trainer, bystander = trainer_and_bystander(root, match)
    with daemon:
        base = f"http://{reachable_address()}:{daemon.port}"
        # Anyone who reaches the scrape port: nothing happens, nothing is disclosed.
        for method, path in [
            ("POST", "/v1/drill?deadline=5"),
            ("GET", "/v1/status"),
            ("GET", "/v1/advice"),
        ]:
            code, body = http(method, base + path)
            assert code == 404, (path, code, body)
            assert json.loads(body).keys() == {"error"}
            for secret in ("run1", s3_dest, str(root), "destination", "runs"):
                assert secret not in body, (path, body)
        assert not daemon.events_named("notice_received")
        assert trainer.poll() is None and bystander.poll() is None
        # No notice, so no signal (the toy trainer also saves every 30 s on its own).
        assert not (root / ".ckptd" / "preemption.json").exists()
        assert daemon.metric("ckptd_preemption_notice") == 0.0
        # What the scrape port is for still works.
        code, metrics = http("GET", base + "/metrics")
        assert code == 200 and "ckptd_destination_up 1.0" in metrics
        assert http("GET", base + "/healthz")[0] == 200
        code, body = http("GET", base + "/v1/preemption")
        assert code == 200 and json.loads(body) == {"notice": False}

        # On the node: `ckptd status` and `ckptd drill` find the control socket.
        cli_env = daemon.env
        if kind != "compose":  # (compose passes its watch to run as a flag; this reads the file)
            # An operator upgrading this config is told, in one line, what moved.
            check = run_cli("config", "check", config=daemon.config, env=cli_env)
            assert check.returncode == 0, check.stderr
            (note,) = [ln for ln in check.stderr.splitlines() if "http.listen" in ln]
            assert "metrics.listen" in note and "/v1/drill" in note
        status = run_cli("status", "--json", config=daemon.config, env=cli_env)
        assert status.returncode == 0, status.stderr
        assert "run1" in json.loads(status.stdout)["runs"]
        drill = run_cli("drill", "--deadline", "60", "--json", config=daemon.config, env=cli_env)
        assert drill.returncode == 0, drill.stdout + drill.stderr
        report = json.loads(drill.stdout)
        assert report["trainer_pids"] == [trainer.pid], report
        assert report["skipped_pids"] == [bystander.pid], report
        assert report["committed_before_deadline"], report
        (skipped,) = daemon.events_named("trainer_signal_skipped")
        assert skipped["pid"] == bystander.pid and match in skipped["cmdline"]
        assert daemon.metric("ckptd_trainer_signal_skipped_total") == 1.0
        assert bystander.poll() is None and trainer.poll() is None
        assert daemon.stop() == 0


def token_daemon(tmp: Path, local_s3: LocalS3, dest: str, **http_keys: str) -> tuple[Daemon, Path]:
    root, port = tmp / "run", free_port()
    root.mkdir()
    lines = [
        "[[watch]]",
        f"dir = {json.dumps(str(root))}",
        'run_id = "run1"',
        "[destination]",
        f"url = {json.dumps(dest)}",
        f"endpoint_url = {json.dumps(local_s3.endpoint_url)}",
        "[preemption]",
        'provider = "none"',
        "[trainer]",
        'match = "ckptd-token-test-trainer"',
        "[metrics]",
        f'listen = "0.0.0.0:{port}"',
        "[http]",
        *[f"{k} = {json.dumps(v)}" for k, v in http_keys.items()],
        "[state]",
        f"dir = {json.dumps(str(tmp / 'state'))}",
    ]
    config = tmp / "ckptd.toml"
    config.write_text("\n".join(lines) + "\n")
    return Daemon(config, tmp / "daemon.log", port), root


def test_a_reachable_control_listener_without_a_token_is_refused(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    daemon, _ = token_daemon(tmp_path, local_s3, s3_dest, listen="0.0.0.0:0")
    result = run_cli("run", config=daemon.config, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "http.listen" in result.stderr and "token_file" in result.stderr
    assert "Traceback" not in result.stderr


def test_token_file_guards_the_control_api_and_never_shows(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, trainer_and_bystander: Any
) -> None:
    token_file = tmp_path / "secret" / "token"
    token_file.parent.mkdir()
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    control = free_port()
    daemon, root = token_daemon(
        tmp_path, local_s3, s3_dest, listen=f"0.0.0.0:{control}", token_file=str(token_file)
    )
    trainer, _ = trainer_and_bystander(root, "ckptd-token-test-trainer")
    check = run_cli("config", "check", config=daemon.config, timeout=60)
    assert check.returncode == 0, check.stderr
    assert str(token_file) in check.stdout
    with daemon:
        for base in (f"http://127.0.0.1:{daemon.port}", f"http://127.0.0.1:{control}"):
            for token in (None, "wrong", TOKEN + "x"):
                code, body = http("POST", base + "/v1/drill?deadline=5", token)
                assert (code, json.loads(body)) == (401, {"error": "unauthorized"})
                assert http("GET", base + "/v1/status", token)[0] == 401
            assert not daemon.events_named("notice_received")
            assert not daemon.events_named("token_file_readable")  # 0600: nothing to say
            assert not (root / ".ckptd" / "preemption.json").exists()
            code, body = http("GET", base + "/v1/status", TOKEN)
            assert code == 200 and "run1" in json.loads(body)["runs"]
            assert TOKEN not in body
        # The CLI reads the same file; one that holds another token is told so.
        url = f"http://127.0.0.1:{control}"
        status = run_cli("status", "--json", "--url", url, config=daemon.config)
        assert status.returncode == 0, status.stderr
        wrong = tmp_path / "wrong.toml"
        wrong_file = tmp_path / "wrong-token"
        wrong_file.write_text("not-the-token\n")
        wrong.write_text(daemon.config.read_text().replace(str(token_file), str(wrong_file)))
        refused = run_cli("status", "--url", url, config=wrong)
        assert refused.returncode == 1
        assert "answered but refused the token" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        # Nowhere to be seen: logs, status, config check, any process's command line.
        assert TOKEN not in daemon.log_text()
        assert TOKEN not in status.stdout + status.stderr + check.stdout + check.stderr
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                assert TOKEN.encode() not in cmdline.read_bytes()
            except OSError:
                continue
        assert trainer.poll() is None
        assert daemon.stop() == 0


def test_a_drill_with_no_trainer_says_none_was_signalled(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    helped = run_cli("drill", "--help")
    assert "default 120" in helped.stdout
    daemon, _ = token_daemon(tmp_path, local_s3, s3_dest, token_file=str(tmp_path / "token"))
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "token").chmod(0o644)
    with daemon:
        # A token file others can read is taken, with one warning naming it and the fix
        # (as ssh warns of such a private key; ckptd doctor fails on it).
        (warned,) = daemon.events_named("token_file_readable")
        assert warned["file"] == str(tmp_path / "token"), warned
        assert warned["fix"] == f"chmod 600 {tmp_path / 'token'}" and "0644" in warned["why"]
        drill = run_cli("drill", "--deadline", "1", config=daemon.config)  # the socket
        assert drill.returncode == 1, drill.stderr  # nothing committed: no trainer saved
        (line,) = [ln for ln in drill.stdout.splitlines() if "trainer signalled" in ln]
        assert "no process signalled" in line and "0.000" not in line
        assert "none found" in drill.stdout
        # Over TCP with no token at hand: the daemon answered, and asked for one.
        bare = tmp_path / "bare.toml"
        bare.write_text(daemon.config.read_text().replace(f'token_file = "{tmp_path}/token"', ""))
        asked = run_cli("status", "--url", f"http://127.0.0.1:{daemon.port}", config=bare)
        assert asked.returncode == 1
        assert "answered but asks for a token" in asked.stderr, asked.stderr
        assert "HTTP Error" not in asked.stderr
        assert daemon.stop() == 0


def test_a_drill_whose_matched_process_has_no_handler_spares_it_and_says_so(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    # A process matching trainer.match that catches no SIGUSR1 (a pager on the log, a
    # trainer still importing): SIGUSR1 would kill it, so the drill spares it and says so.
    daemon, _ = token_daemon(tmp_path, local_s3, s3_dest, token_file=str(tmp_path / "token"))
    (tmp_path / "token").write_text(TOKEN)
    code = "import time; time.sleep(120)"
    bystander = subprocess.Popen([sys.executable, "-c", code, "ckptd-token-test-trainer"])
    try:
        with daemon:
            # Over TCP with the right token this time (the socket is covered above).
            drill = run_cli(
                "drill",
                "--deadline",
                "1",
                "--json",
                "--url",
                f"http://127.0.0.1:{daemon.port}",
                config=daemon.config,
            )
            assert drill.returncode == 1, drill.stdout + drill.stderr  # nothing saved
            report = json.loads(drill.stdout)
            assert report["trainer_pids"] == [] and report["skipped_pids"] == [bystander.pid]
            text = run_cli("drill", "--deadline", "1", config=daemon.config)
            assert "none signalled" in text.stdout and "no process signalled" in text.stdout
            assert f"[{bystander.pid}]" in text.stdout, text.stdout
            assert bystander.poll() is None  # alive: never sent a signal it would die of
            (skipped,) = daemon.events_named("trainer_signal_skipped")  # logged once per PID
            assert skipped["pid"] == bystander.pid
            assert daemon.stop() == 0
    finally:
        bystander.kill()
        bystander.wait()


def test_a_state_dir_too_deep_for_a_socket_address_still_holds_the_control_socket(
    tmp_path: Path,
) -> None:
    # sockaddr_un holds 107 bytes: a state dir deep in a job's scratch space or a pod's
    # volume once made the daemon exit 2 (it could not bind the socket).
    state = tmp_path / ("scratch-" * 8) / ("job-" * 10) / "ckptd-state"
    socket_path = state / "ckptd.sock"
    assert len(os.fsencode(socket_path)) > 107
    (tmp_path / "run").mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": tmp_path / "run", "run_id": "run1"}],
        dest=f"file://{tmp_path / 'store'}",
        state_dir=state,
    )
    with daemon:
        assert socket_path.is_socket() and (socket_path.stat().st_mode & 0o777) == 0o600
        status = run_cli("status", "--json", config=daemon.config)
        assert status.returncode == 0, status.stderr
        assert "run1" in json.loads(status.stdout)["runs"]
        assert daemon.stop() == 0
    assert not socket_path.exists()
