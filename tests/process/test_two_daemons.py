"""Two daemons started by mistake on one watch dir, or on one state dir: the second stops
with one line naming the first's PID; after the first ends (even by ``kill -9``), a new
one starts at once, since the kernel drops the lock with its process."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.writers import write_hf


def _daemon(tmp_path: Path, name: str, watch: Path, state: Path) -> Daemon:
    return Daemon.configured(
        tmp_path,
        name=name,
        watch=[{"dir": watch, "settle_seconds": 0}],
        dest=f"file://{tmp_path / 'store'}",
        state_dir=state,
    )


@pytest.mark.parametrize("shared", ["watch dir", "state dir"])
def test_a_second_daemon_on_the_same_dir_stops_with_one_line(shared: str, tmp_path: Path) -> None:
    watch = tmp_path / "run"
    watch.mkdir()
    first = _daemon(tmp_path, "first", watch, tmp_path / "state-1")
    other_watch = tmp_path / "other-run"
    other_watch.mkdir()
    second = (
        _daemon(tmp_path, "second", watch, tmp_path / "state-2")
        if shared == "watch dir"
        else _daemon(tmp_path, "second", other_watch, tmp_path / "state-1")
    )
    with first:
        assert first.proc is not None
        refused = run_cli("run", "--once", config=second.config, timeout=60)
        assert refused.returncode == 1, refused.stderr
        lines = [line for line in refused.stderr.splitlines() if line.startswith("ckptd:")]
        assert len(lines) == 1 and "Traceback" not in refused.stderr
        assert f"another ckptd (pid {first.proc.pid}) already uses the {shared}" in lines[0]
        # The first one is untouched: it still ships.
        write_hf(watch, 3)
        wait_until(
            lambda: first.events_named("checkpoint_committed", checkpoint="checkpoint-3"),
            30,
            "the first daemon still shipping",
        )
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
    # kill -9 leaves the lock file, not the lock: the next one starts.
    assert (tmp_path / "state-1" / "ckptd.lock").exists()
    again = run_cli("run", "--once", config=second.config, timeout=60)
    assert again.returncode == 0, again.stderr


def test_the_lock_file_holds_the_pid_and_is_never_a_checkpoint(tmp_path: Path) -> None:
    watch = tmp_path / "run"
    watch.mkdir()
    daemon = _daemon(tmp_path, "only", watch, tmp_path / "state")
    with daemon:
        assert daemon.proc is not None
        lock = watch / ".ckptd" / "daemon.lock"
        assert lock.read_text().strip() == str(daemon.proc.pid)
        write_hf(watch, 1)
        wait_until(lambda: daemon.events_named("checkpoint_committed"), 30, "a commit")
        assert [e["checkpoint"] for e in daemon.events_named("checkpoint_detected")] == [
            "checkpoint-1"
        ]
    store = tmp_path / "store"
    stored = [p.relative_to(store).as_posix() for p in store.rglob("*")]
    assert stored and not [p for p in stored if ".ckptd/" in p or p.endswith(".lock")], stored
