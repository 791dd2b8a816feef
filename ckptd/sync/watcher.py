"""File events from watchdog, turned into hints for the pipeline.

Events are only hints: they are lost on NFS and overlay filesystems, and across a
restart, which is why the pipeline also rescans periodically and at start-up. The
watchdog thread never touches pipeline state; it hands the hints to the event loop, the
names a burst of events touched in one call (a save of 100,000 files makes some
300,000 events, and a call per event would keep the loop busy for seconds).

A commit record appearing (``COMMIT_RECORDS`` at a checkpoint's root, created or renamed
into place: DCP's ``.metadata``, orbax's ``commit_success.txt``, a ``marker`` layout's
marker; a tracker; a trainer's save report) is handed over as such (``on_record``): the pipeline looks at it at once,
where other events wait out a debounce (``ckptd.sync.looks``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from ckptd.core import saves
from ckptd.layouts import is_checkpoint_candidate
from ckptd.layouts.base import TRACKER_FILES, RuleSettings
from ckptd.layouts.dcp import METADATA
from ckptd.layouts.orbax import COMMIT_SUCCESS

Hint = Callable[[str, str | None], None]  # (run_id, checkpoint name or None for "all")
#: The files whose appearance at a checkpoint's root ends its save, by default: DCP's
#: ``.metadata`` (renamed into place by its coordinator last), orbax's commit file (where
#: it writes one) and the default marker.
COMMIT_RECORDS: frozenset[str] = frozenset({METADATA, COMMIT_SUCCESS, RuleSettings.marker})
# A record appears by its creation (a marker), its rename into place (DCP's .metadata),
# or its close after writing (a tracker rewritten in place).
_APPEARING = ("created", "moved", "closed")


class _Handler(FileSystemEventHandler):
    def __init__(
        self,
        root: Path,
        run_id: str,
        loop: asyncio.AbstractEventLoop,
        hint: Hint,
        on_record: Hint,
        records: frozenset[str],
    ) -> None:
        self.root = root
        self.run_id = run_id
        self.loop = loop
        self.hint = hint
        self.on_record = on_record
        self.records = records
        self._prefix = str(root).rstrip("/") + "/"
        self._save_report = str(root / saves.RELPATH)
        # Names hinted since the loop last took them; None: "all" (a tracker, a report).
        self._pending: set[str | None] = set()
        # ...and those whose commit record appeared meanwhile.
        self._recorded: set[str | None] = set()
        self._lock = threading.Lock()

    def _queue(self, name: str | None, record: bool = False) -> None:
        with self._lock:
            first = not self._pending and not self._recorded
            (self._recorded if record else self._pending).add(name)
        if first:
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            names, self._pending = self._pending, set()
            recorded, self._recorded = self._recorded, set()
        if None in recorded:
            self.on_record(self.run_id, None)
        elif None in names:
            self.hint(self.run_id, None)
        for name in recorded:
            if name is not None:
                self.on_record(self.run_id, name)
        for name in names - recorded:
            if name is not None:
                self.hint(self.run_id, name)

    def _is_record(self, path: str, child: str) -> bool:
        """``path`` is a commit record at the root of checkpoint ``child``."""
        rest = path[len(self._prefix) + len(child) :]
        return rest[:1] == "/" and rest[1:] in self.records

    def _child(self, text: str) -> str | None:
        # String work, not Path objects: this runs for every event of every file.
        if not text.startswith(self._prefix):
            return None
        return text[len(self._prefix) :].split("/", 1)[0] or None

    def _is_save_report(self, text: str) -> bool:
        return text == self._save_report

    def on_any_event(self, event: FileSystemEvent) -> None:
        kind = event.event_type
        if kind in ("opened", "closed_no_write"):
            return
        # What appears: a file created or closed after writing, a rename's destination.
        sides = (
            (event.src_path, kind in _APPEARING and kind != "moved"),
            (getattr(event, "dest_path", ""), kind == "moved"),
        )
        for raw, appears in sides:
            if not raw:
                continue
            path = raw.decode() if isinstance(raw, bytes) else raw
            child = self._child(path)
            if child is None:
                continue
            if child in TRACKER_FILES or self._is_save_report(path):
                # A tracker (DeepSpeed's `latest`, Megatron's iteration file) completes a
                # sibling; a trainer's save report (ckptd.core.saves) may complete one at once.
                self._queue(None, record=appears)
            elif is_checkpoint_candidate(child, True) or is_checkpoint_candidate(child, False):
                self._queue(child, record=appears and self._is_record(path, child))


class Watcher:
    """One watchdog observer over every watch dir that exists."""

    def __init__(
        self,
        dirs: dict[str, Path],
        hint: Hint,
        on_record: Hint | None = None,
        records: dict[str, frozenset[str]] | None = None,
    ) -> None:
        """``hint``: a file event under a run's dir; ``on_record``: a commit record
        appeared (default: ``hint``); ``records``: each run's commit records
        (default: ``COMMIT_RECORDS``)."""
        self.dirs = dirs
        self.hint = hint
        self.on_record = on_record or hint
        self.records = records or {}
        self._observer: Observer | None = None  # type: ignore[valid-type]
        self._watching: set[str] = set()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._observer = Observer()
        self._observer.daemon = True
        self.refresh()
        self._observer.start()

    def refresh(self) -> list[str]:
        """Start watching dirs that have appeared since; returns the runs now watched."""
        if self._observer is None:
            return []
        for run_id, root in self.dirs.items():
            if run_id in self._watching or not root.is_dir():
                continue
            try:
                handler = _Handler(
                    root,
                    run_id,
                    self._loop,
                    self.hint,
                    self.on_record,
                    self.records.get(run_id, COMMIT_RECORDS),
                )
                self._observer.schedule(handler, str(root), recursive=True)
                self._watching.add(run_id)
            except OSError:
                continue  # vanished or unwatchable: the periodic rescan still covers it
        return sorted(self._watching)

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
