"""What a restore leaves beside the checkpoints it wrote: ``DIR/.ckptd/restored.json``.

One JSON object, local checkpoint name -> ``{"run", "slot", "step", "trajectory",
"began_at", "restored_at", "files": {path: [size, mtime_ns]}}``: the committed content
each name was restored from, when the restore began and when it was done (Unix times: the
daemon beside the trainer records that time in the run ledger, ``ckptd.goodput.restored``),
and its files exactly as the restore wrote them (every one with the same mtime). A daemon watching ``DIR`` reads it (``ckptd.sync.lineage.restored_as``): a
checkpoint whose files are still as recorded is committed already, so it needs no quiet
window and is never shipped again, and a trainer that resumes from it resumes from that
slot. A file that changed since makes the record not apply.

Written under the restore's lock on ``DIR``, read-modify-write, to a temporary name and
renamed; names no longer present in ``DIR`` are dropped. Everything is done relative to
``DIR``'s descriptor without following a symlink, so nothing is written outside ``DIR``.
Best effort: a failure is logged, never fails the restore it follows.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from ckptd.core import handoff
from ckptd.core.manifest import Manifest

# A record larger than this is not one of ours (it would hold a million files' entries).
MAX_RECORD_BYTES = 64 * 1024 * 1024


def _read(dir_fd: int) -> dict[str, Any]:
    try:
        fd = os.open(handoff.RESTORED.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as fh:
        try:
            doc = json.loads(fh.read(MAX_RECORD_BYTES))
        except ValueError:
            return {}
    return doc if isinstance(doc, dict) else {}


def _still_there(target_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=target_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def record_restore(
    target_fd: int, manifest: Manifest, mtime_ns: int, log: Any, *, began_at: float
) -> None:
    """Record that ``DIR/<local name>`` is ``manifest``'s content, its files all given
    ``mtime_ns`` by the restore that began at ``began_at`` (module doc)."""
    name = manifest.local_name
    entry = {
        "run": manifest.run_id,
        "slot": manifest.checkpoint,
        "step": manifest.step,
        "trajectory": manifest.lineage.id,
        "began_at": round(began_at, 3),
        "restored_at": time.time(),
        "files": {f.path: [f.size, mtime_ns] for f in manifest.files},
    }
    meeting = handoff.DIR.name
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(meeting, 0o755, dir_fd=target_fd)
        dir_fd = os.open(meeting, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=target_fd)
    except OSError as exc:
        log.warning("restore_record_not_written", error=str(exc))
        return
    try:
        doc = {k: v for k, v in _read(dir_fd).items() if _still_there(target_fd, k)}
        doc[name] = entry
        tmp = f".{handoff.RESTORED.name}.{os.getpid()}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd
        )
        with os.fdopen(fd, "wb") as fh:
            fh.write(json.dumps(doc, sort_keys=True).encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, handoff.RESTORED.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except OSError as exc:
        log.warning("restore_record_not_written", error=str(exc))
    finally:
        os.close(dir_fd)
