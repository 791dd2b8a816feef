"""Learn, inside the trainer process, that the daemon has seen a preemption notice.

The daemon announces a notice three ways (docs/design.md, "Trainer signalling"): it writes
``<watch dir>/.ckptd/preemption.json``, sends a signal (``SIGUSR1`` by default) to the
trainer, and answers ``GET /v1/preemption``. :class:`PreemptionListener` listens on any of
them; ``preempted()`` is cheap enough to call on every training step.

Most notices end the node: save, then stop. A health ``save`` (docs/health.md) asks for a
save only: its notice says so (:func:`save_only`), and once the trainer has saved for it
(:meth:`PreemptionListener.saved`, which ``ckptd.trainer.report_save`` calls) the listener
is no longer preempted, and the next notice is heard again.

This module imports only the standard library: trainers pull it in without any of the
daemon's dependencies.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from ckptd.core import handoff

__all__ = [
    "DEFAULT_SIGNAL",
    "DEFAULT_URL",
    "NOTICE_RELPATH",
    "PreemptionListener",
    "notice_path",
    "parse_notice",
    "parse_signal",
    "save_only",
]

log = logging.getLogger("ckptd.trainer")

DEFAULT_SIGNAL = signal.SIGUSR1
DEFAULT_URL = "http://127.0.0.1:9464/v1/preemption"
NOTICE_RELPATH = handoff.NOTICE

ENV_WATCH_DIR = "CKPTD_WATCH_DIR"
ENV_SIGNAL = "CKPTD_SIGNAL"
ENV_URL = "CKPTD_URL"
ENV_TOKEN = "CKPTD_TOKEN"

# A notice recorded this long before the listener started still counts: it covers coarse
# file-time granularity (2 s on FAT/some network filesystems) and a trainer started in the
# same second as the notice. Older ones are left over from an earlier run or a drill.
STALE_SLACK_SECONDS = 2.0
# A notice learnt by signal is read from its file, which the daemon writes just after the
# signal: asked whether to stop, the listener waits this long at most for the file.
NOTICE_FILE_WAIT_SECONDS = 2.0
# The kind of a health save's notice, on the node it began and on those that follow it.
SAVE_ONLY_KIND = "health-save"

_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def notice_path(watch_dir: str | os.PathLike[str]) -> Path:
    """Return where the daemon writes the notice for ``watch_dir``."""
    return Path(watch_dir) / NOTICE_RELPATH


def parse_signal(value: int | str) -> signal.Signals | None:
    """Turn ``SIGUSR1``, ``USR1``, ``10`` or a number into a signal; ``none``/``off`` -> None.

    Raises ValueError naming the value when it is no signal of this platform.
    """
    if isinstance(value, int):
        return signal.Signals(value) if value else None
    text = value.strip()
    if text.lower() in ("none", "off", "0"):
        return None
    if text.isdigit():
        return signal.Signals(int(text))
    name = text.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {value!r} (e.g. SIGUSR1, USR2, 12)") from None


def parse_notice(body: bytes | str) -> dict[str, Any] | None:
    """Return the notice in a daemon answer or notice file, or None; never raises.

    A notice is a JSON object with ``source`` or ``kind``; ``{"notice": false}``, other JSON
    and malformed text are no notice.
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("notice") is False:
        return None
    if "source" not in data and "kind" not in data:
        return None
    return data


def save_only(notice: dict[str, Any] | None) -> bool:
    """Whether ``notice`` asks for a save only, the trainer training on after it (a
    health ``save``: kind ``health-save``, or ``detail.action`` ``"save"``); any other
    notice, and an unknown one (None), asks to save and stop."""
    if notice is None:
        return False
    detail = notice.get("detail")
    action = detail.get("action") if isinstance(detail, dict) else None
    return notice.get("kind") == SAVE_ONLY_KIND or action == "save"


def _timestamp(value: object) -> float | None:
    """RFC 3339 text -> POSIX seconds, None when absent or unreadable."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:  # the contract says RFC 3339, which always has an offset
        return None
    return moment.timestamp()


class PreemptionListener:
    """Listens for the daemon's preemption notice by signal, notice file and/or HTTP.

    Each source is optional; an argument left as None falls back to its environment
    variable (``CKPTD_WATCH_DIR``, ``CKPTD_SIGNAL``, ``CKPTD_URL``, ``CKPTD_TOKEN``):

    - ``signum``: signal to catch (default SIGUSR1; ``"none"`` turns it off). The handler
      only sets a flag and then calls the Python handler it replaced, if any. It can only be
      installed from the main thread; elsewhere the listener logs a warning and relies on
      the other sources. Install it at start-up: until then, SIGUSR1 kills the process.
    - ``watch_dir``: the daemon's watch dir; the notice file beneath it is looked for at
      most every ``file_poll_interval`` seconds, one ``stat`` per look.
    - ``url``: the daemon's ``/v1/preemption``, polled every ``http_poll_interval`` seconds
      from a daemon thread (off unless given; see :data:`DEFAULT_URL`), with
      ``Authorization: Bearer <token>`` when a token is set.

    A notice recorded before ``since`` (POSIX seconds; default: now) is stale, left over
    from an earlier run or a drill, and ignored. Once preempted, the listener stays so,
    unless the notice asks for a save only (:func:`save_only`) and :meth:`saved` says the
    trainer has saved for it: then it is preempted again only by a later notice.
    """

    def __init__(
        self,
        watch_dir: str | os.PathLike[str] | None = None,
        *,
        signum: int | str | None = None,
        url: str | None = None,
        token: str | None = None,
        file_poll_interval: float = 0.5,
        http_poll_interval: float = 1.0,
        http_timeout: float = 2.0,
        since: float | None = None,
    ) -> None:
        if watch_dir is None:
            watch_dir = os.environ.get(ENV_WATCH_DIR) or None
        if signum is None:
            signum = os.environ.get(ENV_SIGNAL) or DEFAULT_SIGNAL
        if url is None:
            url = os.environ.get(ENV_URL) or None
        if token is None:
            token = os.environ.get(ENV_TOKEN) or None

        self._since = (time.time() if since is None else since) - STALE_SLACK_SECONDS
        self._file_poll_interval = file_poll_interval
        self._next_file_check = 0.0
        self._notice_file: Path | None = None
        self.watch_dir = Path(watch_dir) if watch_dir is not None else None

        # Flags written by the signal handler and the HTTP thread, read on every step.
        # Plain attribute stores are atomic under the GIL; a lock or Event here could
        # deadlock when the handler interrupts the main thread while it holds that lock.
        self._signalled = False
        self._noticed = False
        self._notice: dict[str, Any] | None = None
        # Save-only notices the trainer saved for: their file (inode, mtime) and ids, so
        # the file the daemon leaves until the save commits is not heard a second time.
        self._handled_file: tuple[int, int] | None = None
        self._notice_read: tuple[int, int] | None = None  # the file _notice was read from
        self._handled_ids: set[str] = set()
        # Between the HTTP thread and saved() (never taken by the signal handler).
        self._lock = threading.Lock()

        self._signum = parse_signal(signum)
        self._previous_handler: _SignalHandler = None
        self._handler_installed = False
        if self._signum is not None:
            self._install_handler(self._signum)

        self.url = url
        self._token = token
        self._http_poll_interval = http_poll_interval
        self._http_timeout = http_timeout
        self._stop = threading.Event()
        self._http_thread: threading.Thread | None = None
        if url:
            self._start_http()

    # -- configuration -------------------------------------------------------------------

    @property
    def watch_dir(self) -> Path | None:
        """The watch dir whose notice file is looked for, or None."""
        return self._watch_dir

    @watch_dir.setter
    def watch_dir(self, value: str | os.PathLike[str] | None) -> None:
        self._watch_dir = Path(value) if value is not None else None
        self._notice_file = notice_path(self._watch_dir) if self._watch_dir else None
        self._next_file_check = 0.0

    @property
    def signum(self) -> signal.Signals | None:
        """The signal this listener catches, or None."""
        return self._signum if self._handler_installed else None

    # -- queries -------------------------------------------------------------------------

    def preempted(self) -> bool:
        """Return True once a notice has arrived by any source; cheap, call it every step."""
        if self._signalled or self._noticed:
            return True
        if self._notice_file is None:
            return False
        now = time.monotonic()
        if now < self._next_file_check:
            return False
        self._next_file_check = now + self._file_poll_interval
        if self._notice_file_is_fresh() and not (self._handled_ids and self._rewritten()):
            self._noticed = True
        return self._noticed

    def notice(self) -> dict[str, Any] | None:
        """Return the notice's JSON (source, kind, deadline, noticed_at) if known, else None.

        A notice learnt only by signal has no details until the notice file is readable.
        """
        if self._notice is None and self._notice_file is not None and self._notice_file_is_fresh():
            with contextlib.suppress(OSError), self._notice_file.open("rb") as f:
                # Not cached when unreadable: the daemon may still be writing it.
                found = parse_notice(f.read())
                if found is not None and found.get("id") not in self._handled_ids:
                    st = os.fstat(f.fileno())
                    self._notice, self._notice_read = found, (st.st_ino, st.st_mtime_ns)
        return dict(self._notice) if self._notice is not None else None

    def stop_requested(self, wait: float = NOTICE_FILE_WAIT_SECONDS) -> bool:
        """Whether the notice asks the trainer to stop after its save: True for every
        notice but a save-only one (:func:`save_only`); False when not preempted. Ask it
        after :meth:`preempted` turned True (after the save, or where the save is decided).

        A notice learnt by signal alone is read from the notice file, waited for up to
        ``wait`` seconds (the daemon writes it just after the signal); still unknown, it
        is taken as a stop, as every notice was before save-only ones.
        """
        if not self.preempted():
            return False
        notice = self.notice()
        if notice is None and self._notice_file is not None:
            deadline = time.monotonic() + wait
            while notice is None and time.monotonic() < deadline:
                time.sleep(0.02)
                notice = self.notice()
        return not save_only(notice)

    def saved(self) -> None:
        """The trainer has saved for the notice: a save-only one is done with (no longer
        preempted, its file and id not heard again; the next notice is); a notice that
        asks to stop stays, and so does preemption before any notice is known.

        Called where this process has not heard the notice itself yet (another rank did,
        and every rank saved), a save-only notice file already there is done with too:
        its signal came before it, so none is left to come."""
        notice = self.notice()
        if notice is None or not save_only(notice):
            return
        with self._lock:
            if isinstance(notice.get("id"), str):
                self._handled_ids.add(notice["id"])
            # The file this notice was read from: a newer one (a cloud's notice that
            # replaced it meanwhile) stays fresh, and is heard at the next look.
            if self._notice_read is not None:
                self._handled_file = self._notice_read
            self._signalled = self._noticed = False
            self._notice = self._notice_read = None
            self._next_file_check = 0.0

    def wait(self, timeout: float | None = None) -> bool:
        """Block until preempted or ``timeout`` seconds pass; return ``preempted()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.preempted():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            # Polling, not an Event: the signal handler must not take locks (see __init__).
            time.sleep(0.05 if remaining is None else min(0.05, remaining))
        return True

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the HTTP poller and put back the signal handler this listener replaced."""
        self._stop.set()
        if self._http_thread is not None and self._http_thread is not threading.current_thread():
            self._http_thread.join(timeout=self._http_timeout + 1.0)
        self._http_thread = None
        atexit.unregister(self._ignore_at_exit)
        if self._handler_installed and self._signum is not None:
            self._handler_installed = False
            # Only undo our own installation: if someone replaced our handler since, putting
            # the old one back would silently drop theirs.
            if signal.getsignal(self._signum) == self._on_signal:
                try:
                    signal.signal(self._signum, self._previous_handler or signal.SIG_DFL)
                except ValueError:
                    log.warning(
                        "ckptd: cannot restore %s handler off the main thread", self._signum.name
                    )

    def __enter__(self) -> PreemptionListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sources -------------------------------------------------------------------------

    def _install_handler(self, signum: signal.Signals) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "ckptd: not on the main thread, so no %s handler; relying on the notice file/HTTP",
                signum.name,
            )
            return
        self._previous_handler = signal.getsignal(signum)
        signal.signal(signum, self._on_signal)
        self._handler_installed = True
        atexit.register(self._ignore_at_exit)

    def _ignore_at_exit(self) -> None:
        # Python's finalisation puts a handled signal back to its default action, and
        # SIGUSR1's kills: a late notice (with many nodes, the other daemons signal one
        # store poll after the first) would turn a clean exit after the save into death by
        # signal. From the last atexit call on, the signal is ignored (it stays so).
        signum = self._signum
        if signum is None or not self._handler_installed:
            return
        if signal.getsignal(signum) == self._on_signal:
            signal.signal(signum, signal.SIG_IGN)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes, possibly inside any other code: set a
        # flag and nothing more; the training loop does the work at its next step.
        self._signalled = True
        previous = self._previous_handler
        # SIG_DFL / SIG_IGN are not chained: the default for SIGUSR1 kills the process.
        if callable(previous) and self._handler_installed:
            previous(signum, frame)

    def _notice_file_is_fresh(self) -> bool:
        if self._notice_file is None:
            return False
        try:
            st = self._notice_file.stat()
        except OSError:
            return False
        if self._handled_file == (st.st_ino, st.st_mtime_ns):
            return False  # a save-only notice saved for; a new one is a new file (rename)
        return st.st_mtime >= self._since

    def _rewritten(self) -> bool:
        """Whether the fresh notice file is a save-only notice saved for, written anew
        (the daemon restates a notice whose deadline moved): then it is no new notice,
        and this file is not read again. Read only after a save-only notice."""
        assert self._notice_file is not None
        try:
            with self._notice_file.open("rb") as f:
                found = parse_notice(f.read())
                st = os.fstat(f.fileno())
        except OSError:
            return False
        if found is None or found.get("id") not in self._handled_ids:
            return False
        self._handled_file = (st.st_ino, st.st_mtime_ns)
        return True

    def _start_http(self) -> None:
        self._http_thread = threading.Thread(
            target=self._poll_http, name="ckptd-preemption-poll", daemon=True
        )
        self._http_thread.start()

    def _poll_http(self) -> None:
        assert self.url is not None
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        failing = False
        while not self._stop.is_set():
            try:
                request = urllib.request.Request(self.url, headers=headers)
                with urllib.request.urlopen(request, timeout=self._http_timeout) as response:
                    body = response.read(64 * 1024)
            except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, bad URL
                # Logged once per outage: the daemon may simply not be up yet.
                if not failing:
                    log.warning("ckptd: cannot poll %s: %s", self.url, exc)
                failing = True
            else:
                failing = False
                notice = parse_notice(body)
                if notice is not None and self._is_fresh(notice):
                    with self._lock:
                        if notice.get("id") not in self._handled_ids:
                            self._notice, self._notice_read = notice, None
                            self._noticed = True
                    # A save-only notice ends: keep polling for the next one (saved()).
                    if not save_only(notice):
                        return
            self._stop.wait(self._http_poll_interval)

    def _is_fresh(self, notice: dict[str, Any]) -> bool:
        noticed_at = _timestamp(notice.get("noticed_at"))
        return noticed_at is None or noticed_at >= self._since
