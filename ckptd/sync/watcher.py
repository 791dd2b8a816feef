"""File events from watchdog, turned into hints for the pipeline.

Events are only hints: they are lost on NFS and overlay filesystems, and across a
restart, which is why the pipeline also rescans periodically and at start-up. The
watchdog thread never touches pipeline state; it hands the hints to the event loop, the
names a burst of events touched in one call (a save of 100,000 files makes some
300,000 events, and a call per event would keep the loop busy for seconds).
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
from ckptd.layouts.base import TRACKER_FILES

Hint = Callable[[str, str | None], None]  # (run_id, checkpoint name or None for "all")


class _Handler(FileSystemEventHandler):
    def __init__(
        self, root: Path, run_id: str, loop: asyncio.AbstractEventLoop, hint: Hint
    ) -> None:
        self.root = root
        self.run_id = run_id
        self.loop = loop
        self.hint = hint
        self._prefix = str(root).rstrip("/") + "/"
        self._save_report = str(root / saves.RELPATH)
        # Names hinted since the loop last took them; None: "all" (a tracker, a report).
        self._pending: set[str | None] = set()
        self._lock = threading.Lock()

    def _queue(self, name: str | None) -> None:
        with self._lock:
            first = not self._pending
            self._pending.add(name)
        if first:
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            names, self._pending = self._pending, set()
        if None in names:
            self.hint(self.run_id, None)
        for name in names:
            if name is not None:
                self.hint(self.run_id, name)

    def _child(self, text: str) -> str | None:
        # String work, not Path objects: this runs for every event of every file.
        if not text.startswith(self._prefix):
            return None
        return text[len(self._prefix) :].split("/", 1)[0] or None

    def _is_save_report(self, text: str) -> bool:
        return text == self._save_report

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        for raw in (event.src_path, getattr(event, "dest_path", "")):
            if not raw:
                continue
            path = raw.decode() if isinstance(raw, bytes) else raw
            child = self._child(path)
            if child is None:
                continue
            if child in TRACKER_FILES or self._is_save_report(path):
                # A tracker (DeepSpeed's `latest`, Megatron's iteration file) completes a
                # sibling; a trainer's save report (ckptd.core.saves) may complete one at once.
                self._queue(None)
            elif is_checkpoint_candidate(child, True) or is_checkpoint_candidate(child, False):
                self._queue(child)


class Watcher:
    """One watchdog observer over every watch dir that exists."""

    def __init__(self, dirs: dict[str, Path], hint: Hint) -> None:
        self.dirs = dirs
        self.hint = hint
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
                self._observer.schedule(
                    _Handler(root, run_id, self._loop, self.hint), str(root), recursive=True
                )
                self._watching.add(run_id)
            except OSError:
                continue  # vanished or unwatchable: the periodic rescan still covers it
        return sorted(self._watching)

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
