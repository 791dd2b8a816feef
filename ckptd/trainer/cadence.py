"""Save on the daemon's advised interval instead of a fixed step count (opt-in).

The daemon publishes, per run, how much training time to leave between checkpoints
(docs/design.md, "Checkpoint cadence advice"): in ``<watch dir>/.ckptd/advice.json``, and at
``GET /v1/advice``. :class:`AdvisedCadence` reads it, from the file when there is one, else
over HTTP in a background thread (``CKPTD_URL``'s daemon), and re-reads it as it changes;
:meth:`AdvisedCadence.due` says whether a save is due now. It also tells the daemon what
each save cost: one JSON line per save in ``<watch dir>/.ckptd/saves.jsonl``.

A plain training loop::

    from ckptd.trainer.cadence import AdvisedCadence

    cadence = AdvisedCadence("/data/ckpt/run1")
    for step, batch in enumerate(loader):
        train_step(batch)
        if cadence.due():                       # never while a save is being written
            with cadence.saving(f"step-{step}"):
                save_checkpoint(f"/data/ckpt/run1/step-{step}")

An asynchronous save (``torch.distributed.checkpoint.async_save``) calls
:meth:`AdvisedCadence.started` when it begins and :meth:`AdvisedCadence.finished` when
its future completes: until then ``due()`` is False, so a save never starts while the
previous one is still being written. With several ranks, agree on the decision
(``ckptd.trainer.agree_to_save(cadence.due())``): each rank's clock is its own.

The first save of this object (the trainer started or restarted after an interruption)
comes after the advice's ``restart_interval_seconds`` when it is shorter: where the run's
interruptions come in bursts, the next one is likely soon after a restart
(``ckptd.cadence.model``, "After a restart"). Saves after that follow ``interval_seconds``.

Standard library only, as the rest of ``ckptd.trainer`` (and ``ckptd.core.handoff``, the file
names both sides share).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ckptd.core import handoff

__all__ = [
    "ADVICE_RELPATH",
    "SAVES_RELPATH",
    "AdvisedCadence",
    "advice_url",
    "parse_advice",
    "report_save",
]

log = logging.getLogger("ckptd.trainer")

ADVICE_RELPATH = handoff.ADVICE
SAVES_RELPATH = handoff.SAVES
ENV_WATCH_DIR = "CKPTD_WATCH_DIR"
ENV_URL = "CKPTD_URL"
ENV_TOKEN = "CKPTD_TOKEN"
ENV_RUN = "CKPTD_RUN"


def advice_url(url: str) -> str:
    """The advice endpoint of the daemon ``url`` names (its base, or any ``/v1/...`` URL,
    such as ``CKPTD_URL``'s ``/v1/preemption``)."""
    base = url.split("/v1/", 1)[0].rstrip("/")
    return f"{base}/v1/advice"


def parse_advice(
    body: bytes | str, run: str | None = None, key: str = "interval_seconds"
) -> float | None:
    """The advised interval (seconds; ``key`` names which) in an advice file or a
    ``/v1/advice`` answer, for ``run`` (the only run when None); None when there is none
    or it is not one."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    runs = doc.get("runs")
    if isinstance(runs, dict):  # /v1/advice
        if run is not None:
            doc = runs.get(run)
        elif len(runs) == 1:
            doc = next(iter(runs.values()))
        else:
            return None
        if not isinstance(doc, dict):
            return None
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        return None
    return float(value)


class AdvisedCadence:
    """Whether a save is due on the daemon's advised interval (module doc).

    ``watch_dir`` (else ``CKPTD_WATCH_DIR``) is where the advice file is read and the save
    reports written; ``url`` (else ``CKPTD_URL``) is asked when there is no file. Until
    any advice arrives, ``due()`` is False: the trainer's own schedule, if any, stands.
    """

    def __init__(
        self,
        watch_dir: str | os.PathLike[str] | None = None,
        *,
        run: str | None = None,
        url: str | None = None,
        token: str | None = None,
        refresh_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        env_dir = os.environ.get(ENV_WATCH_DIR, "")
        self._watch_dir: Path | None = None
        self.watch_dir = watch_dir if watch_dir is not None else (env_dir or None)
        self.run = run if run is not None else (os.environ.get(ENV_RUN) or None)
        env_url = os.environ.get(ENV_URL, "")
        self.url = advice_url(url) if url else (advice_url(env_url) if env_url else None)
        self._token = token if token is not None else os.environ.get(ENV_TOKEN, "")
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._interval: float | None = None
        self._restart_interval: float | None = None
        # The advice file as last read: (inode, mtime, size); the daemon replaces it by a
        # rename, so a new advice is a new inode even within one timestamp tick.
        self._file_mtime: tuple[int, int, int] | None = None
        self._next_read = 0.0
        self._since = clock()
        self._started: float | None = None
        self._http_interval: float | None = None
        self._http_restart_interval: float | None = None
        self._saved = False  # a save has finished: the restart interval is spent
        self._http_thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def watch_dir(self) -> Path | None:
        return self._watch_dir

    @watch_dir.setter
    def watch_dir(self, value: str | os.PathLike[str] | None) -> None:
        self._watch_dir = Path(value) if value is not None else None
        self._file_mtime = None
        self._next_read = 0.0

    # -- the advice ---------------------------------------------------------------------

    def interval(self) -> float | None:
        """The advised seconds of training between saves, or None before any advice."""
        now = self._clock()
        if now >= self._next_read:
            self._next_read = now + self.refresh_seconds
            self._read_file()
            if self._file_mtime is None and self.url is not None:
                self._start_http()
        if self._file_mtime is None and self._http_interval is not None:
            return self._http_interval
        return self._interval

    def restart_interval(self) -> float | None:
        """The advised seconds of training before the first save after a (re)start, from
        the same advice as :meth:`interval`; None when the advice gives none."""
        if self._file_mtime is None and self._http_interval is not None:
            return self._http_restart_interval
        return self._restart_interval

    def _read_file(self) -> None:
        if self._watch_dir is None:
            return
        path = self._watch_dir / ADVICE_RELPATH
        try:
            st = path.stat()
            mtime = (st.st_ino, st.st_mtime_ns, st.st_size)
            if mtime == self._file_mtime:
                return
            body = path.read_bytes()
        except OSError:
            self._file_mtime = None
            return
        value = parse_advice(body, self.run)
        if value is not None:
            if value != self._interval:
                log.info("ckptd: advised checkpoint interval %.0f s", value)
            self._interval, self._file_mtime = value, mtime
            self._restart_interval = parse_advice(body, self.run, "restart_interval_seconds")

    def _start_http(self) -> None:
        if self._http_thread is None:
            self._http_thread = threading.Thread(
                target=self._poll_http, name="ckptd-advice", daemon=True
            )
            self._http_thread.start()

    def _poll_http(self) -> None:
        assert self.url is not None
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        while not self._stop.is_set():
            try:
                request = urllib.request.Request(self.url, headers=headers)
                with urllib.request.urlopen(request, timeout=2.0) as response:
                    body = response.read(256 * 1024)
                value = parse_advice(body, self.run)
                if value is not None:
                    self._http_restart_interval = parse_advice(
                        body, self.run, "restart_interval_seconds"
                    )
                    self._http_interval = value
            except (OSError, ValueError):
                pass  # the daemon may not be up yet; the last advice stands
            self._stop.wait(self.refresh_seconds)

    def close(self) -> None:
        """Stop the HTTP poller, if one runs."""
        self._stop.set()

    # -- saves --------------------------------------------------------------------------

    @property
    def saving_now(self) -> bool:
        return self._started is not None

    def due(self) -> bool:
        """True when the advised interval has passed since the last save ended (before
        the first save: the restart interval, when shorter) and no save is being written."""
        if self._started is not None:
            return False
        interval = self.interval()
        if interval is None:
            return False
        restart = self.restart_interval()
        if not self._saved and restart is not None:
            interval = min(interval, restart)
        return self._clock() - self._since >= interval

    def reset(self) -> None:
        """Count the interval from now (training starts or resumes)."""
        self._since = self._clock()

    def started(self, at: float | None = None) -> None:
        """A save begins (``at``: its start on this object's clock, default now)."""
        self._started = self._clock() if at is None else at

    def finished(self, checkpoint: str | None = None, step: int | None = None) -> float:
        """The save begun by :meth:`started` is written; report its time to the daemon.
        Returns the seconds it took (0 when none was started)."""
        now = self._clock()
        seconds = 0.0 if self._started is None else max(0.0, now - self._started)
        if self._started is not None:
            self.report(seconds, checkpoint=checkpoint, step=step)
        self._started = None
        self._since = now
        self._saved = True
        return seconds

    @contextlib.contextmanager
    def saving(self, checkpoint: str | None = None, step: int | None = None) -> Iterator[None]:
        """``with cadence.saving(name): save(...)``: times a blocking save."""
        self.started()
        try:
            yield
        except BaseException:
            self._started = None  # a failed save reports nothing; the interval restarts
            self._since = self._clock()
            raise
        self.finished(checkpoint, step)

    def report(
        self, seconds: float, *, checkpoint: str | None = None, step: int | None = None
    ) -> None:
        """Report a finished save and its blocking time to the daemon (:func:`report_save`)."""
        if self._watch_dir is not None:
            report_save(self._watch_dir, checkpoint=checkpoint, step=step, seconds=seconds)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return default


def report_save(
    watch_dir: str | os.PathLike[str],
    *,
    checkpoint: str | None = None,
    step: int | None = None,
    seconds: float | None = None,
) -> None:
    """Tell the daemon this process's part of a save is written (call it after the save
    returned, on every rank that writes to ``watch_dir``): one JSON line appended to
    ``<watch dir>/.ckptd/saves.jsonl`` with one ``write`` on an ``O_APPEND`` file, so lines
    from several processes never interleave.

    The daemon times saves from these (the cadence advice), and once every local rank
    (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``, as torchrun and accelerate set them) has
    reported a checkpoint it takes it as complete without waiting out its quiet window.
    Never raises: a report that cannot be written costs only that wait."""
    line: dict[str, Any] = {"at": time.time()}
    if seconds is not None:
        line["save_seconds"] = round(seconds, 4)
    if checkpoint is not None:
        line["checkpoint"] = checkpoint
    if step is not None:
        line["step"] = step
    ranks = max(1, _env_int("LOCAL_WORLD_SIZE", 1))
    if ranks > 1:
        line["rank"] = _env_int("LOCAL_RANK", 0)
        line["ranks"] = ranks
    path = Path(watch_dir) / SAVES_RELPATH
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:
        log.debug("ckptd: cannot report the save: %s", exc)
