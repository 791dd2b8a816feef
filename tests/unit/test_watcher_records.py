"""Which file events are a commit record appearing (``ckptd.sync.watcher``): looked at at
once, where every other event is a plain hint (debounced by ``ckptd.sync.looks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
)

from ckptd.sync.watcher import COMMIT_RECORDS, _Handler

ROOT = Path("/watch/run")


class _Loop:
    """Keeps what the watchdog thread hands over, for ``run`` (the loop's turn)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.calls.append((fn, args))

    def run(self) -> None:
        for fn, args in self.calls:
            fn(*args)


def seen(event: FileSystemEvent) -> tuple[list[Any], list[Any]]:
    hints: list[Any] = []
    records: list[Any] = []
    loop = _Loop()
    handler = _Handler(
        ROOT,
        "run",
        loop,  # type: ignore[arg-type]
        lambda run, name: hints.append(name),
        lambda run, name: records.append(name),
        COMMIT_RECORDS | {"DONE"},
    )
    handler.on_any_event(event)
    loop.run()
    return hints, records


@pytest.mark.parametrize(
    "event",
    [
        FileMovedEvent(f"{ROOT}/step-10/.metadata.tmp", f"{ROOT}/step-10/.metadata"),  # DCP
        FileCreatedEvent(f"{ROOT}/step-10/DONE"),  # a configured marker
        FileClosedEvent(f"{ROOT}/step-10/COMPLETE"),
        FileCreatedEvent(f"{ROOT}/step-10/commit_success.txt"),  # orbax
    ],
)
def test_a_commit_record_appearing_is_handed_over_as_one(event: FileSystemEvent) -> None:
    assert seen(event) == ([], ["step-10"])


@pytest.mark.parametrize(
    "event",
    [
        FileCreatedEvent(f"{ROOT}/step-10/__0_0.distcp"),  # a shard
        FileModifiedEvent(f"{ROOT}/step-10/.metadata"),  # written, not appearing
        FileDeletedEvent(f"{ROOT}/step-10/.metadata"),  # DCP removes the old one first
        FileMovedEvent(f"{ROOT}/step-10/.metadata", f"{ROOT}/step-10/.metadata.old"),
        FileCreatedEvent(f"{ROOT}/step-10/sub/.metadata"),  # not at the root
        FileCreatedEvent(f"{ROOT}/step-10/.metadata.tmp"),
    ],
)
def test_other_events_are_plain_hints(event: FileSystemEvent) -> None:
    assert seen(event) == (["step-10"], [])


def test_a_tracker_written_is_a_record_for_the_whole_run() -> None:
    assert seen(FileClosedEvent(f"{ROOT}/latest")) == ([], [None])
    assert seen(FileModifiedEvent(f"{ROOT}/latest")) == ([None], [])
