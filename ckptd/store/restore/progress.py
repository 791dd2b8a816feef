"""How far a restore has got: a rich bar on a terminal, otherwise a structlog line every
``PROGRESS_LOG_SECONDS``. Only the download loop's thread touches it."""

from __future__ import annotations

import time
from typing import Any

PROGRESS_LOG_SECONDS = 10.0


class RestoreProgress:
    """A rich progress bar on a terminal; otherwise a structlog line every few seconds."""

    def __init__(self, log: Any, total: int, done: int, *, bar: bool) -> None:
        self.log = log
        self.total = total
        self.done = done
        self.started = time.monotonic()
        self.last_log = self.started
        self._bar: Any = None
        self._task: Any = None
        if bar:
            self._bar = _rich_bar()
            self._bar.start()

    def begin(self, name: str) -> None:
        if self._bar is not None:
            self._task = self._bar.add_task(name, total=self.total, completed=self.done)

    def advance(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def tick(self) -> None:
        now = time.monotonic()
        if self._bar is None and now - self.last_log >= PROGRESS_LOG_SECONDS:
            self.last_log = now
            elapsed = max(now - self.started, 1e-9)
            self.log.info(
                "restore_progress",
                bytes_done=self.done,
                bytes_total=self.total,
                mib_per_s=round(self.done / elapsed / 2**20, 1),
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _rich_bar() -> Any:
    """rich's bar on stderr, in MiB/s; imported here so a restore without a terminal
    never loads rich."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class MiBPerSecond(ProgressColumn):
        """rich's TransferSpeedColumn counts MB/s; the summary line says MiB/s."""

        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            shown = "?" if speed is None else f"{speed / 2**20:.1f}"
            return Text(f"{shown} MiB/s", style="progress.data.speed")

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        MiBPerSecond(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


__all__ = ["PROGRESS_LOG_SECONDS", "RestoreProgress"]
