"""The trainer's step report: ``report_step(n)`` once ``n`` steps are done, after each step.

Where it goes: ``<watch dir>/.ckptd/steps.bin``, the step counter
(``ckptd.core.handoff.StepCounterLayout``). The first report opens the file, maps it
(``mmap``, shared) and closes it; every report after that is a clock read (the vDSO: no
system call) and two ``struct.pack_into`` into the mapping: no system call, no device
sync (the step is the caller's integer), about a microsecond (``bench/bench_steps.py``).
The page cache holds what was written after the process dies, ``kill -9`` included, so
the daemon (the goodput recorder of ``ckptd exec`` or of ``ckptd run`` beside the trainer)
reads the last step the trainer completed. When the file was another process's, its last
report is kept in the counter's second slot first, so a daemon that looks only after the
next trainer started still sees where the last one stopped.

Where the counter cannot be mapped (a file system without shared writable mappings), the
report replaces ``steps.json`` instead (tmp + rename; the same fields as JSON) at most
every ``CKPTD_STEP_REPORT_SECONDS`` (default 5; 0: every call).

With ``loss=`` the report carries the step's training loss too (optional: a report
without one is as before): written into ``<watch dir>/.ckptd/losses.bin``, a mapped ring of
the last reports (``ckptd.core.handoff.LossRingLayout``; two more ``pack_into``, no
system call: about 0.4 us more per report), which the daemon reads for its loss-spike rule (docs/health.md, "The
training's own health"). Pass a Python float (``loss.item()`` where the trainer already
takes it): a tensor on a GPU is turned into one here, which waits for the device. Where
the counter cannot be mapped, the last loss rides in ``steps.json``'s optional ``loss``
field (older readers ignore it).

Only local rank 0 reports (every rank is at the same step). Never raises: a report that
cannot be made is logged at debug level and the training goes on.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import time
from pathlib import Path

from ckptd.core.handoff import LOSS_LAYOUT, LOSSES, STEP_COUNTER, STEP_LAYOUT, STEPS

__all__ = ["LOSSES_RELPATH", "STEPS_RELPATH", "STEP_COUNTER_RELPATH", "report_step"]

LOSSES_RELPATH = LOSSES

STEP_COUNTER_RELPATH = STEP_COUNTER
STEPS_RELPATH = STEPS
DEFAULT_REPORT_SECONDS = 5.0
log = logging.getLogger("ckptd.trainer")


class _Counter:
    """This process's slot of the mapped step counter (module doc)."""

    def __init__(self, path: Path, step: int, now: float) -> None:
        layout = STEP_LAYOUT
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            before = os.pread(fd, layout.SIZE, 0)
            if len(before) != layout.SIZE or before[: layout.HEADER.size] != layout.header():
                os.pwrite(fd, layout.header() + bytes(layout.SIZE - layout.HEADER.size), 0)
                os.ftruncate(fd, layout.SIZE)
                before = b""
            self.map = mmap.mmap(fd, layout.SIZE)
        finally:
            os.close(fd)
        self.pid, self.pid_start = os.getpid(), _own_start_ticks()
        current, previous = layout.slot(0), layout.slot(1)
        last = layout.decode(before, 0) if before else None
        if last is not None and last.pid != self.pid:
            # Where the last process stopped, kept for a reader that looks too late.
            self.map[previous : previous + layout.SLOT_SIZE] = before[
                current : current + layout.SLOT_SIZE
            ]
        (self.seq,) = layout.SEQ.unpack_from(self.map, current)
        self.seq_at = current
        self.record_at = (layout.record(0, 0), layout.record(0, 1))
        self.first_step, self.first_at = int(step), now
        self.view = memoryview(self.map)  # held for the process's life: never unmapped
        self.pack_record, self.pack_seq = layout.RECORD.pack_into, layout.SEQ.pack_into
        self.losses_at = path.parent / LOSSES.name
        self.ring: _LossRing | None = None
        self.ring_failed = False

    def write(self, step: int, now: float, loss: float | None = None) -> None:
        if loss is not None:
            self.write_loss(step, loss)
        n = self.seq + 1
        self.pack_record(
            self.view,
            self.record_at[n & 1],
            n,
            step,
            now,
            self.pid,
            self.first_step,
            self.first_at,
            self.pid_start,
        )
        self.pack_seq(self.view, self.seq_at, n)  # after the record: it names it
        self.seq = n

    def write_loss(self, step: int, loss: float) -> None:
        ring = self.ring
        if ring is None:
            if self.ring_failed:
                return
            try:
                ring = self.ring = _LossRing(self.losses_at)
            except (OSError, ValueError) as exc:  # losses are dropped, steps go on
                log.debug("ckptd: cannot map the loss ring: %s", exc)
                self.ring_failed = True
                return
        ring.write(step, loss)


class _LossRing:
    """The mapped loss ring (``ckptd.core.handoff.LossRingLayout``), counting on from the
    reports already in it (another process's before this one)."""

    def __init__(self, path: Path) -> None:
        layout = LOSS_LAYOUT
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            before = os.pread(fd, layout.HEADER.size + layout.COUNT.size, 0)
            if before[: layout.HEADER.size] != layout.header() or os.fstat(fd).st_size != (
                layout.SIZE
            ):
                os.pwrite(fd, layout.header() + bytes(layout.COUNT.size), 0)
                os.ftruncate(fd, layout.SIZE)
            self.map = mmap.mmap(fd, layout.SIZE)
        finally:
            os.close(fd)
        self.view = memoryview(self.map)  # held for the process's life: never unmapped
        self.count_at = layout.HEADER.size
        (self.count,) = layout.COUNT.unpack_from(self.view, self.count_at)
        self.pack_record, self.pack_count = layout.RECORD.pack_into, layout.COUNT.pack_into
        # layout.record(n) is first + ((n - 1) % slots) * size, spelled out below.
        self.first, self.slots, self.size = layout.record(1), layout.SLOTS, layout.RECORD.size

    def write(self, step: int, loss: float) -> None:
        n = self.count + 1
        self.pack_record(
            self.view, self.first + (self.count % self.slots) * self.size, n, step, loss
        )
        self.pack_count(self.view, self.count_at, n)  # after the record: it names it
        self.count = n


def _own_start_ticks() -> int:
    """This process's start in clock ticks since boot (``/proc/self/stat``, field 22; 0
    where there is no /proc): read once, when the counter is mapped."""
    try:
        stat = Path("/proc/self/stat").read_text()
        return int(stat[stat.rfind(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class _JsonReport:
    """The fallback: ``steps.json`` replaced at most every ``CKPTD_STEP_REPORT_SECONDS``."""

    def __init__(self, path: Path, step: int, now: float) -> None:
        self.path = path
        self.first = (int(step), now)
        self.written_at = float("-inf")
        try:
            seconds = float(os.environ.get("CKPTD_STEP_REPORT_SECONDS", DEFAULT_REPORT_SECONDS))
        except ValueError:
            seconds = DEFAULT_REPORT_SECONDS
        self.every = max(0.0, seconds)

    def write(self, step: int, now: float, loss: float | None = None) -> None:
        if now - self.written_at < self.every:
            return
        self.written_at = now
        body: dict[str, object] = {
            "step": step,
            "at": now,
            "pid": os.getpid(),
            "first_step": self.first[0],
            "first_at": self.first[1],
        }
        if loss is not None:
            body["loss"] = loss if math.isfinite(loss) else str(loss)  # JSON has no NaN
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".steps.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.debug("ckptd: cannot report the step: %s", exc)


class _Nowhere:
    """No watch dir (yet: ``final`` False), or a local rank other than 0: nothing to
    report."""

    def __init__(self, *, final: bool) -> None:
        self.final = final

    def write(self, step: int, now: float, loss: float | None = None) -> None:
        pass


_Reporter = _Counter | _JsonReport | _Nowhere
_reporter: _Reporter | None = None
_given: str | os.PathLike[str] | None = None  # the watch_dir argument it was made for


def _forget() -> None:
    """A forked child does not write through its parent's mapping as the parent."""
    global _reporter, _given
    _reporter, _given = None, None


os.register_at_fork(after_in_child=_forget)


def _listening_dir() -> Path | None:
    """The watch dir of the process-wide listener (``ckptd.trainer.install``, a framework
    callback), if it has one: beside ``ckptd run`` no ``CKPTD_WATCH_DIR`` may be set."""
    from ckptd import trainer  # the package, loaded already: it imports this module

    listener = trainer._listener
    return listener.watch_dir if listener is not None else None


def _make(watch_dir: str | os.PathLike[str] | None, step: int, now: float) -> _Reporter:
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return _Nowhere(final=True)
    where = watch_dir if watch_dir is not None else os.environ.get("CKPTD_WATCH_DIR")
    where = where or _listening_dir()
    if not where:
        return _Nowhere(final=False)
    try:
        return _Counter(Path(where) / STEP_COUNTER_RELPATH, step, now)
    except (OSError, ValueError) as exc:  # ValueError: mmap of an odd file
        log.debug("ckptd: cannot map the step counter (%s); %s instead", exc, STEPS_RELPATH)
        return _JsonReport(Path(where) / STEPS_RELPATH, step, now)


def report_step(
    step: int, watch_dir: str | os.PathLike[str] | None = None, *, loss: float | None = None
) -> None:
    """Report that ``step`` steps are done (module doc), with the step's training ``loss``
    when given; a no-op without a watch dir (``watch_dir``, else ``CKPTD_WATCH_DIR``, set
    by ``ckptd exec``, else the one the process-wide listener watches) or on a local rank
    other than 0."""
    global _reporter, _given
    now = time.time()
    reporter = _reporter
    if (
        reporter is None
        or (watch_dir is not None and watch_dir is not _given and watch_dir != _given)
        or (type(reporter) is _Nowhere and not reporter.final and _listening_dir() is not None)
    ):
        reporter = _reporter = _make(watch_dir, step, now)
        _given = watch_dir
    # A plain int is the caller's usual step (int() of a numpy or torch scalar reads it).
    if loss is not None and type(loss) is not float:
        try:
            loss = float(loss)
        except (TypeError, ValueError):
            loss = None
    reporter.write(step if type(step) is int else int(step), now, loss)
