"""The durable journal under ``state.dir``: what is in flight, so a restart resumes it.

sqlite in WAL mode with ``synchronous=NORMAL``: a row committed before a process crash
(``kill -9``) is there after it; a power loss may drop the last few. That is safe
because rows are written *after* the fact they record is durable in the store (a part
acknowledged, an object verified): the journal may under-state progress, never
over-state it, and an under-stated part is simply sent again. (FULL would fsync once
per small file, measured at 11% of the daemon's samples on 4 MiB DCP shards.)

An intended multipart upload is journalled *before* it is created, so an upload
created just before a crash (and not yet recorded) is still found and aborted.

A checkpoint is marked ``touched`` before its first object is sent, so one whose object
reached the store just before a crash (before its row was written) is still known to
hold something there. An object also records the identity its file had when it was read (size, mtime, ctime,
inode; ``ObjectRecord.identity``): a file shipped before its checkpoint was complete
(``ckptd.sync.early``) counts as shipped only while it still has that identity.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptd.commit.single import Slot
from ckptd.config import ConfigError
from ckptd.storage.base import PartInfo

_SCHEMA = """
CREATE TABLE IF NOT EXISTS uploads (
    key TEXT PRIMARY KEY,
    upload_id TEXT,            -- NULL: intended, maybe created, not yet recorded
    run TEXT NOT NULL,
    checkpoint TEXT NOT NULL,
    path TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    part_size INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS parts (
    key TEXT NOT NULL,
    upload_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    size INTEGER NOT NULL,
    etag TEXT NOT NULL,
    crc32c INTEGER NOT NULL,
    PRIMARY KEY (upload_id, number)
);
CREATE TABLE IF NOT EXISTS objects (
    key TEXT PRIMARY KEY,
    run TEXT NOT NULL,
    checkpoint TEXT NOT NULL,
    path TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    crc32c INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL DEFAULT 0,  -- 0: not recorded (a journal of an older ckptd)
    inode INTEGER NOT NULL DEFAULT 0
);
-- A checkpoint's rows, read at each look and each ship: without it, a scan of every row.
CREATE INDEX IF NOT EXISTS objects_of_checkpoint ON objects (run, checkpoint);
CREATE TABLE IF NOT EXISTS touched (  -- may hold objects in the store, not yet committed
    run TEXT NOT NULL,
    checkpoint TEXT NOT NULL,
    PRIMARY KEY (run, checkpoint)
);
CREATE TABLE IF NOT EXISTS committed (
    run TEXT NOT NULL,
    checkpoint TEXT NOT NULL,
    step INTEGER,
    committed_at REAL NOT NULL,
    PRIMARY KEY (run, checkpoint)
);
CREATE TABLE IF NOT EXISTS claims (  -- the slot a local checkpoint ships into (claimed first)
    run TEXT NOT NULL,
    checkpoint TEXT NOT NULL,   -- the local name
    trajectory TEXT NOT NULL,
    slot TEXT NOT NULL,
    canonical TEXT NOT NULL,
    PRIMARY KEY (run, checkpoint, trajectory)
);
CREATE TABLE IF NOT EXISTS meta (  -- this journal's own facts: its writer id
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS conflicts (  -- local checkpoints refused: another content holds the name
    run TEXT NOT NULL,
    checkpoint TEXT NOT NULL,
    fingerprint TEXT NOT NULL,  -- the local files when refused: refused again only if unchanged
    detail TEXT NOT NULL,       -- JSON: who holds the name, as the warning said
    at REAL NOT NULL,
    PRIMARY KEY (run, checkpoint)
);
CREATE TABLE IF NOT EXISTS attempts (  -- a trainer's start: the trajectory decided for it
    run TEXT NOT NULL,
    started REAL NOT NULL,      -- when the trainer started (its report's time)
    report TEXT NOT NULL,       -- what identifies the start (pid and time of the report)
    trajectory TEXT NOT NULL,   -- JSON: ckptd.core.manifest.Trajectory, parent
    PRIMARY KEY (run, report)
);
"""


@dataclass(frozen=True)
class UploadRecord:
    key: str
    upload_id: str | None
    run: str
    checkpoint: str
    path: str
    size: int
    mtime_ns: int
    part_size: int


@dataclass(frozen=True)
class ObjectRecord:
    key: str
    path: str
    size: int
    mtime_ns: int
    crc32c: int
    ctime_ns: int = 0  # 0: not recorded
    inode: int = 0

    @property
    def identity(self) -> tuple[int, int, int, int]:
        """What the file was when read: (size, mtime_ns, ctime_ns, inode)."""
        return (self.size, self.mtime_ns, self.ctime_ns, self.inode)


class Journal:
    """Thread-safe access to the journal database."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "journal.sqlite3"
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            columns = {str(r[1]) for r in self._db.execute("PRAGMA table_info(objects)")}
            for column in ("ctime_ns", "inode"):  # a journal written before they existed
                if column not in columns:
                    self._db.execute(
                        f"ALTER TABLE objects ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0"
                    )
            columns = {str(r[1]) for r in self._db.execute("PRAGMA table_info(committed)")}
            for column in ("slot", "fingerprint"):  # '': written before slots existed
                if column not in columns:
                    self._db.execute(
                        f"ALTER TABLE committed ADD COLUMN {column} TEXT NOT NULL DEFAULT ''"
                    )
            self.writer = self._writer_id()
        except (OSError, sqlite3.Error) as exc:
            # An operator's mistake (a root-owned dir, a read-only mount), not a crash.
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(
                "state.dir",
                f"cannot open the journal in {state_dir} ({reason}); make that directory "
                f"writable by this user (uid {os.getuid()}) or choose another with "
                "state.dir / --state-dir",
            ) from None
        self._lock = threading.Lock()
        self._touched: set[tuple[str, str]] = set()  # rows known written, to skip a write

    def _writer_id(self) -> str:
        """This journal's writer id (``ckptd.commit.single.Writer``): made once, kept for
        good, so a restarted daemon knows its own claims in the store."""
        rows = self._db.execute("SELECT value FROM meta WHERE key = 'writer'").fetchall()
        if rows:
            return str(rows[0][0])
        writer = uuid.uuid4().hex[:16]
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('writer', ?)", (writer,))
        return str(self._db.execute("SELECT value FROM meta WHERE key = 'writer'").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- multipart uploads ----------------------------------------------------------

    def intend_upload(self, rec: UploadRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO uploads VALUES (?, NULL, ?, ?, ?, ?, ?, ?, ?)",
            (
                rec.key,
                rec.run,
                rec.checkpoint,
                rec.path,
                rec.size,
                rec.mtime_ns,
                rec.part_size,
                time.time(),
            ),
        )

    def record_upload_id(self, key: str, upload_id: str) -> None:
        self._exec("UPDATE uploads SET upload_id = ? WHERE key = ?", (upload_id, key))

    def upload_for(self, key: str) -> UploadRecord | None:
        rows = self._exec(
            "SELECT key, upload_id, run, checkpoint, path, size, mtime_ns, part_size FROM uploads WHERE key = ?",
            (key,),
        )
        return UploadRecord(*rows[0]) if rows else None  # type: ignore[arg-type]

    def all_uploads(self) -> list[UploadRecord]:
        rows = self._exec(
            "SELECT key, upload_id, run, checkpoint, path, size, mtime_ns, part_size FROM uploads"
        )
        return [UploadRecord(*r) for r in rows]  # type: ignore[arg-type]

    def record_part(self, key: str, upload_id: str, part: PartInfo) -> None:
        self._exec(
            "INSERT OR REPLACE INTO parts VALUES (?, ?, ?, ?, ?, ?)",
            (key, upload_id, part.number, part.size, part.etag, part.crc32c),
        )

    def parts_for(self, upload_id: str) -> dict[int, PartInfo]:
        rows = self._exec(
            "SELECT number, size, etag, crc32c FROM parts WHERE upload_id = ? ORDER BY number",
            (upload_id,),
        )
        return {int(r[0]): PartInfo(int(r[0]), int(r[1]), str(r[2]), int(r[3])) for r in rows}  # type: ignore[call-overload]

    def forget_upload(self, key: str) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "DELETE FROM parts WHERE upload_id IN (SELECT upload_id FROM uploads WHERE key = ?)",
                (key,),
            )
            self._db.execute("DELETE FROM parts WHERE key = ?", (key,))
            self._db.execute("DELETE FROM uploads WHERE key = ?", (key,))
            self._db.execute("COMMIT")

    # -- finished objects -----------------------------------------------------------

    def record_object(self, run: str, checkpoint: str, rec: ObjectRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO objects "
            "(key, run, checkpoint, path, size, mtime_ns, crc32c, ctime_ns, inode) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                rec.key,
                run,
                checkpoint,
                rec.path,
                rec.size,
                rec.mtime_ns,
                rec.crc32c,
                rec.ctime_ns,
                rec.inode,
            ),
        )

    def record_objects(self, run: str, checkpoint: str, recs: Sequence[ObjectRecord]) -> None:
        """``record_object`` for many, in one transaction (a batch of small files)."""
        rows = [
            (r.key, run, checkpoint, r.path, r.size, r.mtime_ns, r.crc32c, r.ctime_ns, r.inode)
            for r in recs
        ]
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO objects "
                "(key, run, checkpoint, path, size, mtime_ns, crc32c, ctime_ns, inode) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            self._db.execute("COMMIT")

    def object_at(self, key: str) -> ObjectRecord | None:
        """The finished object at ``key``, if the journal holds one."""
        rows = self._exec(
            "SELECT key, path, size, mtime_ns, crc32c, ctime_ns, inode FROM objects WHERE key = ?",
            (key,),
        )
        return ObjectRecord(*rows[0]) if rows else None  # type: ignore[arg-type]

    def objects_for(self, run: str, checkpoint: str) -> dict[str, ObjectRecord]:
        rows = self._exec(
            "SELECT key, path, size, mtime_ns, crc32c, ctime_ns, inode FROM objects "
            "WHERE run = ? AND checkpoint = ?",
            (run, checkpoint),
        )
        return {str(r[1]): ObjectRecord(*r) for r in rows}  # type: ignore[arg-type]

    def touch(self, run: str, checkpoint: str) -> None:
        """Mark ``run/checkpoint`` as maybe holding objects in the store (module doc)."""
        if (run, checkpoint) in self._touched:
            return
        self._exec("INSERT OR IGNORE INTO touched VALUES (?, ?)", (run, checkpoint))
        self._touched.add((run, checkpoint))

    def forget_object(self, key: str) -> None:
        """Drop one finished object (deleted from the store, or to be sent again)."""
        self._exec("DELETE FROM objects WHERE key = ?", (key,))

    def uncommitted(self) -> set[tuple[str, str]]:
        """``(run, checkpoint)`` of every checkpoint with an object or upload in flight, or
        a slot claimed and not committed (a crash between the claim and the first object
        leaves nothing else: the claim must still be found and freed)."""
        rows = self._exec(
            "SELECT run, checkpoint FROM objects UNION SELECT run, checkpoint FROM uploads "
            "UNION SELECT run, checkpoint FROM touched "
            "UNION SELECT run, checkpoint FROM claims AS c WHERE NOT EXISTS "
            "(SELECT 1 FROM committed WHERE run = c.run AND checkpoint = c.checkpoint)"
        )
        return {(str(r[0]), str(r[1])) for r in rows}

    def forget_checkpoint(self, run: str, checkpoint: str) -> None:
        """Drop the in-flight records of a checkpoint (abandoned), and its claims (its
        slots were emptied: ``ckptd.sync.cleanup.discard``)."""
        with self._lock:
            self._db.execute("BEGIN")
            self._delete_in_flight(run, checkpoint)
            self._db.execute(
                "DELETE FROM claims WHERE run = ? AND checkpoint = ?", (run, checkpoint)
            )
            self._db.execute("COMMIT")

    def _delete_in_flight(self, run: str, checkpoint: str) -> None:
        # Caller holds the lock and an open transaction.
        self._db.execute(
            "DELETE FROM parts WHERE upload_id IN "
            "(SELECT upload_id FROM uploads WHERE run = ? AND checkpoint = ?)",
            (run, checkpoint),
        )
        for table in ("uploads", "objects", "touched"):
            self._db.execute(
                f"DELETE FROM {table} WHERE run = ? AND checkpoint = ?", (run, checkpoint)
            )
        self._touched.discard((run, checkpoint))

    # -- commits --------------------------------------------------------------------

    def mark_committed(
        self,
        run: str,
        checkpoint: str,
        step: int | None,
        *,
        slot: str = "",
        fingerprint: str = "",
    ) -> None:
        """Record that the local checkpoint ``checkpoint`` (its files as ``fingerprint``
        says) is committed in ``slot``, and drop its in-flight records and any conflict
        recorded for it, in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO committed (run, checkpoint, step, committed_at, slot, "
                "fingerprint) VALUES (?, ?, ?, ?, ?, ?)",
                (run, checkpoint, step, time.time(), slot or checkpoint, fingerprint),
            )
            self._delete_in_flight(run, checkpoint)
            self._db.execute(
                "DELETE FROM conflicts WHERE run = ? AND checkpoint = ?", (run, checkpoint)
            )
            self._db.execute("COMMIT")

    def committed_files(self, run: str) -> dict[str, tuple[str, str]]:
        """Local checkpoint name -> ``(slot, fingerprint)`` of each committed one (the
        fingerprint '' when recorded before fingerprints were)."""
        rows = self._exec(
            "SELECT checkpoint, slot, fingerprint FROM committed WHERE run = ?", (run,)
        )
        return {str(r[0]): (str(r[1]) or str(r[0]), str(r[2])) for r in rows}

    def forget_committed(self, run: str, checkpoint: str) -> None:
        """The local checkpoint changed after its commit (a re-save): no longer known
        committed as it is."""
        self._exec("DELETE FROM committed WHERE run = ? AND checkpoint = ?", (run, checkpoint))

    # -- claims ---------------------------------------------------------------------

    def record_claim(self, run: str, slot: Slot) -> None:
        self._exec(
            "INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?)",
            (run, slot.name, slot.trajectory, slot.slot, slot.canonical),
        )

    def claim_for(self, run: str, checkpoint: str, trajectory: str) -> Slot | None:
        rows = self._exec(
            "SELECT slot, canonical FROM claims WHERE run = ? AND checkpoint = ? AND trajectory = ?",
            (run, checkpoint, trajectory),
        )
        return Slot(checkpoint, str(rows[0][0]), str(rows[0][1]), trajectory) if rows else None

    def slots_of(self, run: str, checkpoint: str) -> list[str]:
        """Every slot this node claimed for the local checkpoint ``checkpoint``."""
        rows = self._exec(
            "SELECT slot FROM claims WHERE run = ? AND checkpoint = ?", (run, checkpoint)
        )
        return sorted({str(r[0]) for r in rows})

    # -- conflicts ------------------------------------------------------------------

    def record_conflict(self, run: str, checkpoint: str, fingerprint: str, detail: str) -> None:
        self._exec(
            "INSERT OR REPLACE INTO conflicts VALUES (?, ?, ?, ?, ?)",
            (run, checkpoint, fingerprint, detail, time.time()),
        )

    def conflicts(self, run: str) -> dict[str, tuple[str, str]]:
        """Local checkpoint name -> ``(fingerprint, detail JSON)`` of each refused one."""
        rows = self._exec(
            "SELECT checkpoint, fingerprint, detail FROM conflicts WHERE run = ?", (run,)
        )
        return {str(r[0]): (str(r[1]), str(r[2])) for r in rows}

    def forget_conflict(self, run: str, checkpoint: str) -> None:
        self._exec("DELETE FROM conflicts WHERE run = ? AND checkpoint = ?", (run, checkpoint))

    # -- trainer starts and their trajectories ----------------------------------------

    def record_attempt(self, run: str, started: float, report: str, trajectory: str) -> None:
        self._exec(
            "INSERT OR IGNORE INTO attempts VALUES (?, ?, ?, ?)", (run, started, report, trajectory)
        )

    def attempts(self, run: str) -> list[tuple[float, str, str]]:
        """``(started, report, trajectory JSON)`` of the run's trainer starts, oldest first."""
        rows = self._exec(
            "SELECT started, report, trajectory FROM attempts WHERE run = ? ORDER BY started",
            (run,),
        )
        return [(float(r[0]), str(r[1]), str(r[2])) for r in rows]  # type: ignore[arg-type]

    def is_committed(self, run: str, checkpoint: str) -> bool:
        return bool(
            self._exec(
                "SELECT 1 FROM committed WHERE run = ? AND checkpoint = ?", (run, checkpoint)
            )
        )

    def committed(self, run: str) -> list[tuple[str, int | None]]:
        rows = self._exec(
            "SELECT checkpoint, step FROM committed WHERE run = ? ORDER BY committed_at", (run,)
        )
        return [(str(r[0]), r[1] if r[1] is None else int(r[1])) for r in rows]  # type: ignore[call-overload]

    def stats(self) -> dict[str, int]:
        """Row counts, for metrics."""
        out = {}
        for table in ("uploads", "parts", "objects", "committed"):
            out[table] = int(self._exec(f"SELECT COUNT(*) FROM {table}")[0][0])  # type: ignore[call-overload]
        return out
