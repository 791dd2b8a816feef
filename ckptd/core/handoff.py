"""The files under ``<watch dir>/.ckptd/`` through which the daemon and the trainer talk.

Both sides import these names from here, and only from here: the daemon writes
``preemption.json`` (a notice) and ``advice.json`` (the advised cadence) and holds
``daemon.lock``; the trainer helpers (``ckptd.trainer``) read the first two and append
``saves.jsonl`` (their save reports) and keep the step counter ``steps.bin`` (its layout is
here too: ``StepCounterLayout``). A name or a layout spelled on one side only would let the
two drift apart silently. Standard library only, and nothing else of ckptd, so that the
trainer helpers (which import nothing of the daemon) can import it. Formats:
docs/design.md, "Trainer signalling" and "Run ledger (contract)".
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ADVICE",
    "DAEMON_LOCK",
    "DIR",
    "LOSSES",
    "LOSS_LAYOUT",
    "NOTICE",
    "RESTORED",
    "RESUMED",
    "RESUMED_BY_CKPTD",
    "SAVES",
    "STEPS",
    "STEP_COUNTER",
    "STEP_LAYOUT",
    "TRAINER_VARIABLES",
    "LossReport",
    "LossRingLayout",
    "StepCounterLayout",
    "StepRecord",
    "replace_json",
]

# The directory, relative to the watch dir; the daemon skips it when it scans for checkpoints.
DIR = Path(".ckptd")
# A preemption notice, written atomically by the daemon's responder.
NOTICE = DIR / "preemption.json"
# The advised checkpoint cadence, written atomically by the daemon's advisor.
ADVICE = DIR / "advice.json"
# The trainer's save reports, one JSON line per save and rank, appended by the trainer.
SAVES = DIR / "saves.jsonl"
# The trainer's step counter (the step it is at), a memory-mapped file updated each step
# (layout: STEP_LAYOUT below).
STEP_COUNTER = DIR / "steps.bin"
# The same report as JSON, replaced atomically a few times a minute: only where the counter
# cannot be mapped (a file system without shared writable mappings).
STEPS = DIR / "steps.json"
# The trainer's losses (``report_step(step, loss=...)``): a memory-mapped ring of the last
# reports, each kept until ``LOSS_LAYOUT.SLOTS`` more came (layout: LOSS_LAYOUT below).
LOSSES = DIR / "losses.bin"
# What the trainer resumed from (a checkpoint's name, or none: from scratch), written once
# at its start by the trainer helpers or, for its child, by ``ckptd exec``: the daemon
# decides the trajectory of the trainer's saves from it (docs/design.md "Trajectories").
RESUMED = DIR / "resumed.json"
# ``resumed.json``'s ``by`` when ``ckptd exec`` wrote it for its child: ckptd's own choice
# of resume point, never the trainer's rollback (``ckptd.sync.lineage``).
RESUMED_BY_CKPTD = "ckptd"
# The checkpoints ``ckptd restore`` wrote into this directory, with their files as written:
# the daemon knows them committed (no quiet window, nothing shipped again).
RESTORED = DIR / "restored.json"
# The daemon's lock on the watch dir (one daemon per watch dir).
DAEMON_LOCK = DIR / "daemon.lock"

# The environment variables the trainer helpers read: ``ckptd exec`` sets all but the last
# two for its trainer, and a user may set ``CKPTD_STEP_REPORT_SECONDS``; the resume drill
# (``ckptd drill --restore-only --resume-steps N``) sets ``CKPTD_DRILL_RESUME_STEPS`` for
# the trainer it starts. They are not settings of the daemon, which refuses any other
# ``CKPTD_*`` name it does not know (a typo), so it passes these by.
TRAINER_VARIABLES = frozenset(
    {
        "CKPTD_RESUME_FROM",
        "CKPTD_RUN",
        "CKPTD_WATCH_DIR",
        "CKPTD_SIGNAL",
        "CKPTD_URL",
        "CKPTD_TOKEN",
        "CKPTD_STEP_REPORT_SECONDS",
        "CKPTD_DRILL_RESUME_STEPS",
    }
)


def replace_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` so that a reader sees the old file or the new one,
    never half of it: a temporary name in the same directory, then ``os.replace``.
    Creates the directory; OSError when it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document))
    os.replace(tmp, path)


@dataclass(frozen=True)
class StepRecord:
    """One step report: ``step`` steps are done at ``at`` (Unix time) in process ``pid``,
    whose first report was ``first_step`` at ``first_at``. ``pid_start`` is that
    process's start in clock ticks since boot (``/proc/PID/stat``'s ``starttime``, the
    same in every PID namespace; 0: unknown): with ``pid`` it tells the process apart from
    another holding the same number (a reused pid, another namespace's)."""

    step: int
    at: float
    pid: int
    first_step: int
    first_at: float
    pid_start: int = 0


class StepCounterLayout:
    """The step counter file ``steps.bin`` (little-endian, ``SIZE`` bytes):

    - header: ``MAGIC`` (8 bytes), the format (u32, ``FORMAT``), the slot size (u32);
    - slot 0, the current process's reports; slot 1, the last report of the process that
      wrote slot 0 before it (copied there by the next process when it opens the file);
    - a slot: a sequence word ``seq`` (u64), then two records; report ``n`` is written
      whole into record ``n % 2``, and only then is ``seq`` set to ``n``. A record is
      ``(tag, step, at, pid, first_step, first_at, pid_start)``, ``tag`` its ``n``.

    A writer killed mid-report leaves ``seq`` naming the previous, complete record. A
    reader takes a slot only when two reads in a row agree and the record's tag equals
    ``seq`` (a read torn by a concurrent write is retried, never believed)."""

    MAGIC = b"CKPTDSTP"
    FORMAT = 1
    HEADER = struct.Struct("<8sII")
    SEQ = struct.Struct("<Q")
    RECORD = struct.Struct("<QqdqqdQ")
    SLOT_SIZE = SEQ.size + 2 * RECORD.size
    SIZE = HEADER.size + 2 * SLOT_SIZE

    def slot(self, index: int) -> int:
        """The offset of slot ``index`` (0: current, 1: previous)."""
        return self.HEADER.size + index * self.SLOT_SIZE

    def record(self, index: int, seq: int) -> int:
        """The offset of report ``seq``'s record in slot ``index``."""
        return self.slot(index) + self.SEQ.size + (seq % 2) * self.RECORD.size

    def header(self) -> bytes:
        return self.HEADER.pack(self.MAGIC, self.FORMAT, self.SLOT_SIZE)

    def decode(self, data: bytes, index: int) -> StepRecord | None:
        """Slot ``index`` of one read of the file; None when the file is not a counter of
        this format, the slot is empty, or its record is not the one ``seq`` names."""
        if len(data) < self.SIZE or data[: self.HEADER.size] != self.header():
            return None
        (seq,) = self.SEQ.unpack_from(data, self.slot(index))
        if seq == 0:
            return None
        tag, step, at, pid, first_step, first_at, pid_start = self.RECORD.unpack_from(
            data, self.record(index, seq)
        )
        if tag != seq:
            return None
        return StepRecord(step, at, pid, first_step, first_at, pid_start)


STEP_LAYOUT = StepCounterLayout()


@dataclass(frozen=True)
class LossReport:
    """The ``n``-th loss report written to the ring: ``loss`` at ``step``."""

    n: int
    step: int
    loss: float


class LossRingLayout:
    """The loss ring ``losses.bin`` (little-endian, ``SIZE`` bytes):

    - header: ``MAGIC`` (8 bytes), the format (u32, ``FORMAT``), the ring's ``SLOTS`` (u32);
    - ``count`` (u64): how many reports were ever written to this file;
    - ``SLOTS`` records ``(tag, step, loss)`` (u64, i64, f64): report ``n`` (from 1) is
      written whole into record ``(n - 1) % SLOTS`` with tag ``n``, and only then is
      ``count`` set to ``n``. A trainer that opens the file goes on counting from it.

    A reader remembers the last ``n`` it took and takes the records after it whose tag is
    their ``n``: a record being overwritten, or one the ring lapped, is skipped, never
    taken for another report."""

    MAGIC = b"CKPTDLOS"
    FORMAT = 1
    SLOTS = 4096
    HEADER = struct.Struct("<8sII")
    COUNT = struct.Struct("<Q")
    RECORD = struct.Struct("<Qqd")
    SIZE = HEADER.size + COUNT.size + SLOTS * RECORD.size

    def header(self) -> bytes:
        return self.HEADER.pack(self.MAGIC, self.FORMAT, self.SLOTS)

    def record(self, n: int) -> int:
        """The offset of report ``n``'s record."""
        return self.HEADER.size + self.COUNT.size + ((n - 1) % self.SLOTS) * self.RECORD.size

    def count(self, data: bytes) -> int | None:
        """The reports written, or None when ``data`` is not a ring of this format."""
        if len(data) < self.SIZE or data[: self.HEADER.size] != self.header():
            return None
        return int(self.COUNT.unpack_from(data, self.HEADER.size)[0])

    def decode(self, data: bytes, after: int) -> tuple[list[LossReport], int]:
        """The reports after report ``after`` (oldest first) and the count to pass as
        ``after`` next time; a count below ``after`` is a new file: read from its start."""
        count = self.count(data)
        if count is None:
            return [], 0
        first = (after if count >= after else 0) + 1
        found = []
        for n in range(max(first, count - self.SLOTS + 1), count + 1):
            tag, step, loss = self.RECORD.unpack_from(data, self.record(n))
            if tag == n:
                found.append(LossReport(n, step, loss))
        return found, count


LOSS_LAYOUT = LossRingLayout()
