"""A save made for a notice after a routine one that counted as its emergency checkpoint
(``ckptd.supervision.exec_flush``): what the pipeline counts as a newer save in hand
(``RunState.holds_newer``), and how the responder's checkpoint follows the newer commit
(``Responder._superseded``). End to end: ``tests/process/test_exec_newer_save.py``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptd.config import WatchConfig, load_settings
from ckptd.notices.model import Notice
from ckptd.notices.responder import Responder, Response
from ckptd.runtime.metrics import Metrics
from ckptd.sync.runs import Progress, RunState


def run_state(tmp_path: Path) -> RunState:
    return RunState.of(WatchConfig(dir=str(tmp_path), run_id="run"))


def test_nothing_newer_in_hand_when_only_older_or_committed_ones_are(tmp_path: Path) -> None:
    state = run_state(tmp_path)
    state.awaiting["step-30"] = 0.0
    state.committed.update({"step-40", "step-50"})
    assert not state.holds_newer(40, {"step-50", "step-20", "not-a-step"})


@pytest.mark.parametrize("where", ["around", "current", "awaiting", "waiting"])
def test_a_newer_save_anywhere_in_hand_counts(tmp_path: Path, where: str) -> None:
    state = run_state(tmp_path)
    around: set[str] = set()
    if where == "around":
        around.add("step-42")
    elif where == "current":
        state.current = Progress("step-42", 0.0, 1)
    elif where == "awaiting":
        state.awaiting["step-42"] = 0.0
    else:
        state.waiting["step-42"] = None  # type: ignore[assignment]
    assert state.holds_newer(40, around)
    assert not state.holds_newer(42, around)


class NoEmergency:
    def watch_dirs(self) -> list[Path]:
        return []

    def enter_emergency(self, deadline: datetime | None, since: float | None = None) -> None:
        pass

    def move_deadline(self, deadline: datetime | None) -> None:
        pass

    def leave_emergency(self) -> None:
        pass


def responder_with(tmp_path: Path) -> tuple[Responder, Response]:
    settings = load_settings(
        overrides={
            "watch": [{"dir": str(tmp_path), "run_id": "run"}],
            "destination": {"url": f"file://{tmp_path / 'store'}"},
            "state": {"dir": str(tmp_path / "state")},
        },
        environ={},
    )
    responder = Responder(settings, Metrics(), NoEmergency())
    now = datetime.now(UTC)
    notice = Notice("aws", "spot-termination", "x", now, now + timedelta(seconds=120))
    responder.current = Response(notice, None, responder.clock.monotonic())
    return responder, responder.current


async def test_a_newer_emergency_commit_of_the_run_becomes_the_responses(tmp_path: Path) -> None:
    responder, response = responder_with(tmp_path)
    await responder.on_commit("run", "step-40", 10, True)
    assert (response.checkpoint, response.bytes) == ("step-40", 10)
    assert response.done.is_set()
    await responder.on_commit("run", "step-42", 12, True)
    assert (response.checkpoint, response.bytes) == ("step-42", 12)


@pytest.mark.parametrize(
    ("run", "name", "emergency"),
    [
        ("run", "step-39", True),
        ("run", "step-40", True),
        ("other", "step-50", True),
        ("run", "step-50", False),
        ("run", "final", True),
    ],
)
async def test_no_older_foreign_routine_or_stepless_commit_replaces_it(
    tmp_path: Path, run: str, name: str, emergency: bool
) -> None:
    responder, response = responder_with(tmp_path)
    await responder.on_commit("run", "step-40", 10, True)
    await responder.on_commit(run, name, 99, emergency)
    assert (response.checkpoint, response.bytes) == ("step-40", 10)
