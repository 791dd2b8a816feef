"""The restores of a run into its watch dir, as the daemon beside the trainer (``ckptd
run``) learns of them: it did not see them happen (a pod's init step runs before it), and
records them in the run ledger.

The source is the record every ``ckptd restore`` leaves beside what it wrote,
``<dir>/.ckptd/restored.json`` (``ckptd.store.restore.record``, docs/design.md "Restored
checkpoints and fresh nodes"): local name -> ``{"run", "slot", "step", ..., "began_at",
"restored_at", ...}``. Read here, never written: an entry of another run, or without two
finite times in order (one written before ``began_at`` was recorded), is no restore.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ckptd.core.handoff import RESTORED

RESTORED_RELPATH = RESTORED
# A record larger than this is not one to read 4 times a second.
MAX_RECORD_BYTES = 1024 * 1024

__all__ = ["RESTORED_RELPATH", "RestoreRecord", "read_restores"]


@dataclass(frozen=True)
class RestoreRecord:
    """One restore of ``run_id`` into the watch dir: ``checkpoint`` (its local name) at
    ``step``, from ``began_at`` until it was in place, ``restored_at`` (Unix times)."""

    run_id: str
    checkpoint: str
    step: int | None
    began_at: float
    restored_at: float


def _time(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def read_restores(watch_dir: Path, run_id: str) -> list[RestoreRecord]:
    """``run_id``'s restores recorded in ``watch_dir``, oldest first (module doc)."""
    try:
        with open(watch_dir / RESTORED_RELPATH, "rb") as fh:
            doc = json.loads(fh.read(MAX_RECORD_BYTES))
    except (OSError, ValueError):
        return []
    if not isinstance(doc, dict):
        return []
    out = []
    for name, entry in doc.items():
        if not isinstance(entry, dict) or entry.get("run") != run_id:
            continue
        began, done = _time(entry.get("began_at")), _time(entry.get("restored_at"))
        step = entry.get("step")
        if began is None or done is None or done < began:
            continue
        ok_step = isinstance(step, int) and not isinstance(step, bool)
        out.append(RestoreRecord(run_id, str(name), step if ok_step else None, began, done))
    return sorted(out, key=lambda r: r.restored_at)
