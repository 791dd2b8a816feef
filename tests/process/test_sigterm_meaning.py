"""SIGTERM: a preemption when the machine or pod goes away, a plain stop when only ckptd is
stopped or restarted (``systemctl restart ckptd`` must not stop training).

systemd is asked through ``systemctl is-system-running`` (systemctl(1): it prints the
state, "stopping" during a shutdown, and exits non-zero for any state but "running").
A running systemd cannot be had in this sandbox, so a ``systemctl`` on PATH prints the
state a file holds: the documented output, nothing more.
"""

from __future__ import annotations

import signal
import stat
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3
from ckptd.notices.shutdown import sigterm_meaning, system_state
from tests.e2e.test_preemption_e2e import Trainer
from tests.support.daemon import Daemon, wait_until


def _fake_systemctl(bin_dir: Path, state_file: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "systemctl"
    script.write_text(
        "#!/bin/sh\n"
        '[ "$1" = is-system-running ] || exit 2\n'
        f'read -r state < "{state_file}"\n'
        'echo "$state"\n'
        '[ "$state" = running ]\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def _progress(root: Path) -> int | None:
    """The toy trainer's step; None while it is rewriting the file (read mid-write)."""
    text = (root / ".progress").read_text().strip()
    return int(text) if text else None


@pytest.mark.parametrize(
    ("mode", "environ", "state", "notice"),
    [
        ("notice", {"INVOCATION_ID": "x"}, "running", True),
        ("stop", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "stopping", False),
        ("auto", {"INVOCATION_ID": "x"}, "running", False),
        ("auto", {"INVOCATION_ID": "x"}, "degraded", False),
        ("auto", {"INVOCATION_ID": "x"}, "stopping", True),
        ("auto", {"INVOCATION_ID": "x"}, None, True),  # cannot ask: the safe side
        ("auto", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "running", True),
        ("auto", {}, "running", True),
    ],
)
def test_what_a_sigterm_means(
    mode: Any, environ: dict[str, str], state: str | None, notice: bool
) -> None:
    asked: list[bool] = []

    def current() -> str | None:
        asked.append(True)
        return state

    meaning = sigterm_meaning(mode, environ, current)
    assert meaning.notice is notice, meaning.why
    # systemd is asked only where its answer decides.
    assert bool(asked) == (mode == "auto" and "INVOCATION_ID" in environ)


@pytest.mark.parametrize("state", ["running", "stopping", "degraded"])
def test_system_state_reads_systemctls_output_whatever_its_exit_code(
    state: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "state").write_text(state)
    _fake_systemctl(tmp_path / "bin", tmp_path / "state")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert system_state() == state


def test_system_state_is_unknown_without_systemctl_or_when_it_cannot_ask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert system_state() is None
    (tmp_path / "state").write_text("offline")  # systemctl's word for "no systemd here"
    _fake_systemctl(tmp_path / "bin", tmp_path / "state")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert system_state() is None


@pytest.mark.parametrize(("state", "notice"), [("running", False), ("stopping", True)])
def test_under_systemd_a_restart_leaves_the_trainer_training_and_a_shutdown_saves(
    state: str,
    notice: bool,
    tmp_path: Path,
    local_s3: LocalS3,
    s3_dest: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (tmp_path / "state-of-systemd").write_text(state)
    _fake_systemctl(tmp_path / "bin", tmp_path / "state-of-systemd")
    trainer = Trainer(root)
    try:
        daemon = Daemon.configured(
            tmp_path,
            watch=[{"dir": root, "settle_seconds": 0.2}],
            dest=s3_dest,
            endpoint_url=local_s3.endpoint_url,
            state_dir=tmp_path / "state",
        )
        daemon.config.write_text(
            daemon.config.read_text() + f'[trainer]\npidfile = "{trainer.pidfile}"\n'
        )
        daemon.env = {
            "INVOCATION_ID": "0123456789abcdef",  # what systemd sets for every unit
            "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        }
        with daemon:
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
            assert daemon.proc.wait(timeout=30) == 0
        notice_file = root / ".ckptd" / "preemption.json"
        if notice:
            assert daemon.events_named("sigterm_is_a_notice")
            assert daemon.events_named("trainer_signalled")
            wait_until(trainer.saved, 20, "the trainer's emergency save")
        else:
            (event,) = daemon.events_named("sigterm_is_a_stop")
            assert "restarts ckptd alone" in event["why"]
            assert not daemon.events_named("trainer_signalled")
            assert not notice_file.exists()
            # Still training: its progress moves on after the daemon is gone.
            before = wait_until(lambda: _progress(root), 10, "the trainer's progress")
            wait_until(
                lambda: (_progress(root) or 0) > before + 5, 10, "the trainer still training"
            )
            assert trainer.proc.poll() is None and trainer.saved() is None
    finally:
        trainer.close()
