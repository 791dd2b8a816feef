"""The notice file as the daemon writes it into a watch dir (``ckptd.trainer.notice_path``),
for tests of the trainer side: a temporary name renamed over it, so a reader never sees
half a notice."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckptd.trainer import notice_path

# A health save (#47): the trainer saves, then trains on.
HEALTH_SAVE = {
    "source": "health",
    "kind": "health-save",
    "id": "health:xid-63:1",
    "deadline": None,
    "noticed_at": None,
    "detail": {"action": "save", "event": "xid-63"},
}


def replace_notice(watch_dir: Path, body: dict[str, object]) -> None:
    """As the daemon writes it: a temporary name renamed over the notice file."""
    path = notice_path(watch_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)
