"""PreemptionListener and the module-level helpers, with real signals, files, HTTP and processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType

import pytest

import ckptd.trainer
from ckptd.trainer import PreemptionListener, notice_path, parse_notice, parse_signal
from tests.support.daemon import wait_until
from tests.support.notice_file import HEALTH_SAVE, replace_notice
from tests.support.trainers.procs import REPO, Script, script_env

NOTICE = {
    "source": "aws",
    "kind": "terminate",
    "deadline": "2026-12-02T12:02:00Z",
    "noticed_at": "2026-12-02T12:00:00Z",
}
NOTICE_NOW = {**NOTICE, "noticed_at": None}


@pytest.fixture
def listeners() -> Iterator[list[PreemptionListener]]:
    """Listeners made by a test, closed afterwards (newest first) so handlers unwind."""
    made: list[PreemptionListener] = []
    yield made
    for listener in reversed(made):
        listener.close()
    ckptd.trainer.uninstall()


@pytest.fixture(autouse=True)
def no_ckptd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CKPTD_WATCH_DIR", "CKPTD_SIGNAL", "CKPTD_URL", "CKPTD_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def write_notice(watch_dir: Path, body: str | None = None) -> Path:
    path = notice_path(watch_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(NOTICE) if body is None else body)
    return path


# -- signal -----------------------------------------------------------------------------


def test_signal_to_this_process_sets_preempted(listeners: list[PreemptionListener]) -> None:
    listener = PreemptionListener()
    listeners.append(listener)
    assert listener.signum == signal.SIGUSR1
    assert not listener.preempted()

    os.kill(os.getpid(), signal.SIGUSR1)

    wait_until(listener.preempted, 5, "preempted() after SIGUSR1")
    assert listener.wait(0)
    assert listener.notice() is None  # a bare signal carries no details


def test_signal_chains_to_previous_python_handler_and_close_restores_it(
    listeners: list[PreemptionListener],
) -> None:
    seen: list[int] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    original = signal.signal(signal.SIGUSR2, previous)
    try:
        listener = PreemptionListener(signum="USR2")
        listeners.append(listener)
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_until(lambda: listener.preempted() and seen, 5, "both handlers ran")
        assert seen == [signal.SIGUSR2]

        listener.close()
        assert signal.getsignal(signal.SIGUSR2) is previous
    finally:
        signal.signal(signal.SIGUSR2, original)


def test_close_restores_default_disposition(listeners: list[PreemptionListener]) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    listener = PreemptionListener()
    listeners.append(listener)
    assert signal.getsignal(signal.SIGUSR1) != before
    listener.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_signal_from_env_and_none_disables_it(
    listeners: list[PreemptionListener], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_SIGNAL", "SIGUSR2")
    listener = PreemptionListener()
    listeners.append(listener)
    assert listener.signum == signal.SIGUSR2

    before = signal.getsignal(signal.SIGUSR1)
    off = PreemptionListener(signum="none")
    listeners.append(off)
    assert off.signum is None
    assert signal.getsignal(signal.SIGUSR1) == before


def test_off_main_thread_skips_the_handler_but_still_sees_the_file(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    made: list[PreemptionListener] = []
    thread = threading.Thread(target=lambda: made.append(PreemptionListener(tmp_path)))
    thread.start()
    thread.join()
    listener = made[0]
    listeners.append(listener)
    assert listener.signum is None

    write_notice(tmp_path)
    assert listener.wait(5)


def test_parse_signal_accepts_names_numbers_and_rejects_junk() -> None:
    assert parse_signal("SIGUSR1") == signal.SIGUSR1
    assert parse_signal("usr2") == signal.SIGUSR2
    assert parse_signal(str(int(signal.SIGTERM))) == signal.SIGTERM
    assert parse_signal(int(signal.SIGUSR1)) == signal.SIGUSR1
    assert parse_signal("off") is None
    with pytest.raises(ValueError, match="SIGBOGUS"):
        parse_signal("SIGBOGUS")


# -- notice file ------------------------------------------------------------------------


def test_notice_file_appearing_sets_preempted(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    listener = PreemptionListener(tmp_path, signum="none", file_poll_interval=0.05)
    listeners.append(listener)
    assert not listener.preempted()
    assert listener.notice() is None

    write_notice(tmp_path)

    assert listener.wait(5)
    assert listener.notice() == NOTICE


def test_notice_file_check_is_throttled(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    listener = PreemptionListener(tmp_path, signum="none", file_poll_interval=3600)
    listeners.append(listener)
    assert not listener.preempted()  # first call looks, and finds nothing
    write_notice(tmp_path)
    # Within the interval no further stat is made, however often it is asked.
    assert not any(listener.preempted() for _ in range(1000))


def test_watch_dir_from_env(
    tmp_path: Path, listeners: list[PreemptionListener], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_WATCH_DIR", str(tmp_path))
    listener = PreemptionListener(signum="none", file_poll_interval=0.05)
    listeners.append(listener)
    assert listener.watch_dir == tmp_path
    write_notice(tmp_path)
    assert listener.wait(5)


def test_malformed_notice_file_still_preempts_and_never_raises(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    # The file's presence is the notice; its body is detail, and may be half-written.
    write_notice(tmp_path, body='{"source": "aws", "ki')
    listener = PreemptionListener(tmp_path, signum="none", since=0)
    listeners.append(listener)
    assert listener.preempted()
    assert listener.notice() is None

    write_notice(tmp_path)  # the daemon finishes writing it
    assert listener.notice() == NOTICE


def test_stale_notice_file_from_an_earlier_run_is_ignored(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    path = write_notice(tmp_path)
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))

    listener = PreemptionListener(tmp_path, signum="none", file_poll_interval=0)
    listeners.append(listener)
    assert not listener.preempted()
    assert listener.notice() is None

    path.touch()  # rewritten by a new notice
    assert listener.preempted()


@pytest.mark.parametrize(
    "body",
    ["", "not json", "[1, 2]", '"text"', "null", '{"notice": false}', '{"unrelated": 1}', "\xff"],
)
def test_parse_notice_rejects_what_is_not_a_notice(body: str) -> None:
    assert parse_notice(body) is None
    assert parse_notice(body.encode("utf-8", "surrogateescape")) is None


def test_parse_notice_accepts_the_contract_shape() -> None:
    assert parse_notice(json.dumps(NOTICE)) == NOTICE
    assert parse_notice(b'{"source": "gcp", "kind": "preempted"}') is not None


# -- HTTP -------------------------------------------------------------------------------


class FakeDaemon:
    """A loopback stand-in for the daemon's ``/v1/preemption`` endpoint."""

    def __init__(self) -> None:
        self.status = 200
        self.body = json.dumps({"notice": False}).encode()
        self.requests: list[dict[str, str]] = []
        daemon = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                daemon.requests.append({"path": self.path, **dict(self.headers.items())})
                self.send_response(daemon.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(daemon.body)))
                self.end_headers()
                self.wfile.write(daemon.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/preemption"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def wait_for_requests(self, count: int) -> None:
        wait_until(lambda: len(self.requests) >= count, 10, f"{count} polls")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_daemon() -> Iterator[FakeDaemon]:
    server = FakeDaemon()
    yield server
    server.close()


def test_http_notice_sets_preempted_and_sends_the_token(
    fake_daemon: FakeDaemon, listeners: list[PreemptionListener]
) -> None:
    listener = PreemptionListener(
        signum="none", url=fake_daemon.url, token="s3cret", http_poll_interval=0.05
    )
    listeners.append(listener)
    fake_daemon.wait_for_requests(2)
    assert not listener.preempted()

    fake_daemon.body = json.dumps(NOTICE_NOW).encode()

    assert listener.wait(5)
    assert listener.notice() == NOTICE_NOW
    assert fake_daemon.requests[0]["Authorization"] == "Bearer s3cret"
    assert fake_daemon.requests[0]["path"] == "/v1/preemption"


def test_http_url_and_token_from_env(
    fake_daemon: FakeDaemon, listeners: list[PreemptionListener], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_URL", fake_daemon.url)
    monkeypatch.setenv("CKPTD_TOKEN", "from-env")
    fake_daemon.body = json.dumps(NOTICE_NOW).encode()
    listener = PreemptionListener(signum="none")
    listeners.append(listener)
    assert listener.wait(5)
    assert fake_daemon.requests[0]["Authorization"] == "Bearer from-env"


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (200, b'{"notice": false}'),
        (200, b"{not json"),
        (200, b'["source", "kind"]'),
        (401, b'{"error": "unauthorized"}'),
        (500, json.dumps(NOTICE_NOW).encode()),  # an error page is no notice, whatever it says
    ],
)
def test_http_answers_that_are_no_notice_leave_it_false_and_polling(
    fake_daemon: FakeDaemon, listeners: list[PreemptionListener], status: int, body: bytes
) -> None:
    fake_daemon.status, fake_daemon.body = status, body
    listener = PreemptionListener(signum="none", url=fake_daemon.url, http_poll_interval=0.02)
    listeners.append(listener)
    fake_daemon.wait_for_requests(3)  # still polling after bad answers: nothing raised
    assert not listener.preempted()
    assert listener.notice() is None


def test_http_stale_notice_is_ignored(
    fake_daemon: FakeDaemon, listeners: list[PreemptionListener]
) -> None:
    fake_daemon.body = json.dumps(NOTICE).encode()  # noticed_at in the past
    listener = PreemptionListener(signum="none", url=fake_daemon.url, http_poll_interval=0.02)
    listeners.append(listener)
    fake_daemon.wait_for_requests(3)
    assert not listener.preempted()


def test_http_unreachable_daemon_never_raises(listeners: list[PreemptionListener]) -> None:
    listener = PreemptionListener(
        signum="none", url="http://127.0.0.1:9/v1/preemption", http_poll_interval=0.02
    )
    listeners.append(listener)
    assert not listener.wait(0.3)
    listener.close()  # the poller thread stops promptly


# -- module-level helpers ---------------------------------------------------------------


def test_module_preempted_installs_lazily_and_follows_the_watch_dir(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    assert not ckptd.trainer.preempted(first)
    installed = ckptd.trainer.get_listener()
    assert installed.watch_dir == first
    assert ckptd.trainer.get_listener(second) is installed
    assert installed.watch_dir == second

    write_notice(second)
    wait_until(lambda: ckptd.trainer.preempted(second), 5, "preempted() via the notice file")
    assert ckptd.trainer.notice() == NOTICE


def test_install_replaces_the_listener_and_uninstall_restores_the_handler(
    listeners: list[PreemptionListener],
) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    first = ckptd.trainer.install()
    second = ckptd.trainer.install()
    assert ckptd.trainer.get_listener() is second
    assert signal.getsignal(signal.SIGUSR1) == second._on_signal
    assert first.signum is None  # closed
    ckptd.trainer.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_package_imports_without_torch_transformers_or_lightning(tmp_path: Path) -> None:
    code = """
import sys
for name in ("torch", "transformers", "lightning", "pytorch_lightning"):
    sys.modules[name] = None  # makes any import of them fail
import ckptd.trainer
assert not ckptd.trainer.preempted(sys.argv[1])
for name in ("CkptdCallback", "CkptdLightningCallback"):
    try:
        getattr(ckptd.trainer, name)
    except ImportError:
        pass
    else:
        raise SystemExit(name + " imported without its framework")
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=script_env(tmp_path),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# -- a plain training loop in a real process ---------------------------------------------


def test_plain_loop_saves_and_stops_when_the_notice_file_appears(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    script = Script(
        tmp_path, "plain_loop", "--checkpoint-root", str(root), env=script_env(tmp_path)
    )
    script.interrupt_at_step(3, lambda: write_notice(root), step_timeout=20, exit_timeout=20)

    result = script.result_json()
    step = result["global_step"]
    assert 3 <= step < 100_000
    assert result["saved_path"] == str(root / f"step-{step}")
    assert json.loads((root / f"step-{step}" / "state.json").read_text())["step"] == step
    assert (root / f"step-{step}" / "COMPLETE").exists()
    assert result["notice"] == NOTICE


def test_plain_loop_honours_the_configured_signal(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    env = script_env(tmp_path, CKPTD_SIGNAL="SIGUSR2")
    script = Script(tmp_path, "plain_loop", "--checkpoint-root", str(root), env=env)
    script.interrupt_at_step(
        3, lambda: script.signal(signal.SIGUSR2), step_timeout=20, exit_timeout=20
    )

    step = script.result_json()["global_step"]
    assert (root / f"step-{step}" / "COMPLETE").exists()


# -- save-only notices (a health save: save, then train on) ----------------------------


def test_save_only_tells_a_health_save_from_a_notice_that_ends_the_node() -> None:
    assert ckptd.trainer.save_only(HEALTH_SAVE)
    # Followed from another node: the kind stays, the detail is the follower's own.
    assert ckptd.trainer.save_only(
        {"source": "node-0/health", "kind": "health-save", "detail": {"node_rank": 0}}
    )
    assert ckptd.trainer.save_only({"source": "x", "kind": "y", "detail": {"action": "save"}})
    assert not ckptd.trainer.save_only(NOTICE)
    assert not ckptd.trainer.save_only({**NOTICE, "detail": {"action": "terminate"}})
    assert not ckptd.trainer.save_only({"source": "drill", "kind": "drill"})
    assert not ckptd.trainer.save_only(None)


def test_a_health_save_is_heard_once_then_the_next_notice_is_heard_again(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    listener = PreemptionListener(tmp_path, signum="none", file_poll_interval=0.0)
    listeners.append(listener)
    replace_notice(tmp_path, HEALTH_SAVE)
    assert listener.preempted()
    assert listener.stop_requested() is False
    listener.saved()
    assert not listener.preempted()
    assert notice_path(tmp_path).exists()  # withdrawn only once its save commits
    assert not listener.preempted() and listener.notice() is None
    # The same notice written anew (the daemon restates one whose deadline moved).
    replace_notice(tmp_path, {**HEALTH_SAVE, "deadline": "2026-12-02T12:09:00Z"})
    assert not listener.preempted() and listener.notice() is None
    second = {**HEALTH_SAVE, "id": "health:xid-63:2"}
    replace_notice(tmp_path, second)
    assert listener.preempted()
    assert listener.notice() == second
    # A notice that ends the node stays, saved for or not.
    replace_notice(tmp_path, {**NOTICE_NOW, "id": "aws:1"})
    listener.saved()  # for the second health save, read before the cloud's replaced it
    assert listener.preempted()
    assert listener.stop_requested() is True
    listener.saved()
    assert listener.preempted() and listener.stop_requested() is True


def test_a_signal_is_read_as_its_notice_file_once_the_daemon_wrote_it(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    listener = PreemptionListener(tmp_path, file_poll_interval=0.0)
    listeners.append(listener)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert listener.wait(5)
    # The daemon signals first and writes the file just after: asked now, the listener
    # waits for it rather than take a health save for a stop.
    writer = threading.Timer(0.3, replace_notice, (tmp_path, HEALTH_SAVE))
    writer.start()
    try:
        assert listener.stop_requested(wait=10) is False
    finally:
        writer.join()
    listener.saved()
    assert not listener.preempted()
    # A signal whose notice never becomes readable is a stop, as every notice was.
    notice_path(tmp_path).unlink()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert listener.wait(5)
    began = time.monotonic()
    assert listener.stop_requested(wait=0.2) is True
    assert time.monotonic() - began < 5


def test_the_module_helpers_train_on_after_a_health_save(
    tmp_path: Path, listeners: list[PreemptionListener]
) -> None:
    ckptd.trainer.install(tmp_path, signum="none", file_poll_interval=0.0)
    assert not ckptd.trainer.stop_requested()  # no notice: nothing to stop for
    replace_notice(tmp_path, HEALTH_SAVE)
    assert ckptd.trainer.preempted()
    ckptd.trainer.report_save(tmp_path, checkpoint="step-7")
    assert not ckptd.trainer.preempted()
    assert json.loads((tmp_path / ".ckptd" / "saves.jsonl").read_text())["checkpoint"] == "step-7"
    replace_notice(tmp_path, {**HEALTH_SAVE, "id": "health:xid-63:2"})
    assert ckptd.trainer.preempted()
    assert ckptd.trainer.stop_requested_on_any_rank() is False  # no process group: its own
    assert not ckptd.trainer.preempted()
    replace_notice(tmp_path, {**NOTICE_NOW, "id": "aws:1"})
    assert ckptd.trainer.preempted()
    assert ckptd.trainer.stop_requested() is True
    assert ckptd.trainer.preempted()


def test_http_keeps_polling_after_a_health_save_and_hears_the_next_notice(
    fake_daemon: FakeDaemon, listeners: list[PreemptionListener]
) -> None:
    listener = PreemptionListener(signum="none", url=fake_daemon.url, http_poll_interval=0.05)
    listeners.append(listener)
    fake_daemon.body = json.dumps({"notice": True, **HEALTH_SAVE}).encode()
    assert listener.wait(10)
    assert listener.stop_requested() is False
    listener.saved()
    polls = len(fake_daemon.requests)
    fake_daemon.wait_for_requests(polls + 3)  # the same notice, still answered: not again
    assert not listener.preempted()
    fake_daemon.body = json.dumps({"notice": True, **NOTICE_NOW, "id": "aws:1"}).encode()
    assert listener.wait(10)
    assert listener.stop_requested() is True
