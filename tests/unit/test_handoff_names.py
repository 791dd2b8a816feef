"""The files under ``<watch dir>/.ckptd/`` are named once, in ``ckptd.core.handoff``, and
the daemon and the trainer helpers both use those names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ckptd
from ckptd.cadence import advisor
from ckptd.core import handoff, saves
from ckptd.goodput import step_report
from ckptd.notices import responder
from ckptd.runtime import instance
from ckptd.trainer import cadence as trainer_cadence
from ckptd.trainer import listener
from ckptd.trainer import steps as trainer_steps

PACKAGE = Path(ckptd.__file__).parent
FILE_NAMES = (
    "preemption.json",
    "advice.json",
    "saves.jsonl",
    "steps.json",
    "steps.bin",
    "restored.json",
    "daemon.lock",
)


@pytest.mark.parametrize(
    ("daemon_side", "trainer_side", "name"),
    [
        (responder.NOTICE_FILE, listener.NOTICE_RELPATH, "preemption.json"),
        (advisor.ADVICE_RELPATH, trainer_cadence.ADVICE_RELPATH, "advice.json"),
        (saves.RELPATH, trainer_cadence.SAVES_RELPATH, "saves.jsonl"),
        (advisor.SAVES_RELPATH, trainer_cadence.SAVES_RELPATH, "saves.jsonl"),
        (step_report.STEPS_RELPATH, trainer_steps.STEPS_RELPATH, "steps.json"),
        (step_report.STEP_COUNTER_RELPATH, trainer_steps.STEP_COUNTER_RELPATH, "steps.bin"),
    ],
)
def test_the_daemon_and_the_trainer_name_each_file_alike(
    daemon_side: Path, trainer_side: Path, name: str
) -> None:
    assert Path(daemon_side) == Path(trainer_side) == handoff.DIR / name


def test_the_watch_dir_lock_lives_in_the_same_directory() -> None:
    assert instance.WATCH_LOCK == handoff.DAEMON_LOCK
    assert handoff.DAEMON_LOCK.parent == handoff.DIR == Path(".ckptd")


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """Every string literal in ``tree`` that is not a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_no_other_module_spells_a_shared_file_name() -> None:
    spelled: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "core" / "handoff.py":
            continue
        for node in _string_constants(ast.parse(path.read_text())):
            spelled += [
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}"
                for name in FILE_NAMES
                if name in node.value
            ]
    assert spelled == [], "spell these through ckptd.core.handoff: " + ", ".join(spelled)


def test_the_check_sees_a_spelled_name() -> None:
    tree = ast.parse('"""Mentions preemption.json."""\nX = ".ckptd/advice.json"\n')
    values = [node.value for node in _string_constants(tree)]
    assert values == [".ckptd/advice.json"]
