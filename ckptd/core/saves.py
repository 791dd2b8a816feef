"""The trainer's own reports of its saves: ``<watch dir>/.ckptd/saves.jsonl``.

The ckptd trainer helpers (``ckptd.trainer``: the HF callback, ``AdvisedCadence``,
``ckptd.trainer.saved``) append one JSON line per save and rank once the save has
returned: ``checkpoint`` (its name) or ``step``, ``at`` (Unix time of the report),
``save_seconds`` (its blocking time, when timed), and ``rank``/``ranks`` (this process's
local rank and how many local ranks write to this watch dir; absent = 0 of 1).

Two readers: the cadence advisor takes the save time, and the scanner takes the moment
every local rank said it was done (``saved_at_ns``), which lets a completion rule skip
its quiet window: the window is a guess at when a trainer has finished, and the report
is the trainer saying so. Invariant: a report is evidence only for the save it followed.
``saved_at_ns`` answers only when every local rank has reported after the checkpoint's
oldest file was written (not a report left from an earlier save of the same name), and
the rule still requires that no file changed after the last report and none is open for
writing. Only the file's last ``TAIL_BYTES`` are read: the newest reports are there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckptd.core import handoff

RELPATH = handoff.SAVES
# The reports looked at: the newest ones, in this many bytes at the end of the file.
TAIL_BYTES = 64 * 1024


def read_reports(watch_dir: Path) -> list[dict[str, Any]]:
    """The reports at the end of ``watch_dir``'s saves.jsonl, oldest first; [] if none.
    Lines that are not JSON objects (a torn first line of the tail) are skipped."""
    try:
        with (watch_dir / RELPATH).open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return []
    reports: list[dict[str, Any]] = []
    for line in lines:
        try:
            doc = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(doc, dict):
            reports.append(doc)
    return reports


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def is_about(report: dict[str, Any], checkpoint: str, step: int | None) -> bool:
    """Whether ``report`` names ``checkpoint`` (by name, else, when it names none, by step)."""
    named = report.get("checkpoint")
    if named is not None:
        return bool(named == checkpoint)
    return step is not None and report.get("step") == step


def save_seconds(reports: list[dict[str, Any]], checkpoint: str, step: int | None) -> float | None:
    """The newest reported blocking time of ``checkpoint``'s save, or None."""
    for report in reversed(reports):
        seconds = _number(report.get("save_seconds"))
        if seconds is not None and seconds >= 0 and is_about(report, checkpoint, step):
            return seconds
    return None


def saved_at_ns(
    reports: list[dict[str, Any]], checkpoint: str, step: int | None, oldest_mtime_ns: int
) -> int | None:
    """When the last local rank reported ``checkpoint``'s save finished (ns since the
    epoch), counting only reports made after ``oldest_mtime_ns`` (this save's, not an
    earlier save's of the same name); None until every rank has."""
    latest: dict[int, float] = {}  # rank -> its newest report of this save
    ranks = 1
    for report in reports:
        if not is_about(report, checkpoint, step):
            continue
        at = _number(report.get("at"))
        rank = report.get("rank", 0)
        count = report.get("ranks", 1)
        if at is None or not isinstance(rank, int) or not isinstance(count, int) or count < 1:
            continue
        if at * 1e9 < oldest_mtime_ns:
            continue
        latest[rank] = max(at, latest.get(rank, at))
        ranks = count  # the newest report says how many ranks there are
    if not latest or set(range(ranks)) - latest.keys():
        return None
    return int(max(latest.values()) * 1e9)
