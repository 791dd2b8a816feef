"""The node's health as a condition file, for node-problem-detector or NVSentinel.

A platform that drains a node on a GPU fault takes the trainer's work with it unless it
waits for the save. The file says whether the node is healthy and, when it is not,
whether ckptd has saved (``drain``: true once the save for the fault committed, or at
once when no save will come): the platform drains after ckptd has saved, not before.

``{"format": "ckptd.health/1", "healthy", "drain", "reason", "message", "updated_at",
"events"}``, written by rename so a reader never sees half of it.

Invariant: the file is written only when what it says changed, and never raises: a
failed write is logged by the caller and tried again at the next change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FORMAT = "ckptd.health/1"


def condition_body(
    healthy: bool, drain: bool, reason: str, message: str, events: list[dict[str, Any]]
) -> dict[str, Any]:
    """The document, less its time (so two bodies compare equal when nothing changed)."""
    return {
        "format": FORMAT,
        "healthy": healthy,
        "drain": drain,
        "reason": reason,
        "message": message,
        "events": events,
    }


def write_condition(path: Path, body: dict[str, Any], at: float) -> None:
    """Write ``body`` (with ``updated_at``) to ``path`` by rename; OSError if it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**body, "updated_at": at}, indent=1) + "\n")
    os.replace(tmp, path)
