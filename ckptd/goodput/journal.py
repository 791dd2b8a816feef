"""One writer's local journal of ledger records, and its shipping to the store.

Invariants:
- A record is appended (one line, fsync'd) to ``<state dir>/goodput/<run>.jsonl`` before it
  counts anywhere; ``<run>.shipped`` holds how many of those lines the store has. Shipping
  writes the unshipped lines as one new object (``Repository.write_ledger_chunk``) and
  only then advances ``.shipped``. A kill -9 between the two ships the same records again
  under another key: their ids are unchanged, so readers count them once.
- The journal is per run and state dir, not per writer: a later life of a writer on this
  node ships what an earlier one left unshipped (``ship`` first, at its start).
- The store is best effort: a write it refuses is retried at the next ship, never fatal;
  so is the state dir's ``.shipped`` mark (a state dir read-only or full for a while).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from ckptd.goodput.model import Record, chunk_bytes, merge_records, parse_chunk, parse_record
from ckptd.repository import Repository
from ckptd.runtime.logs import get_logger
from ckptd.storage.base import StorageError


def read_ledger(repo: Repository, run_id: str) -> list[Record]:
    """Every record of the run's ledger in the store (StorageError when unreadable)."""
    return merge_records(*(parse_chunk(c) for c in repo.read_ledger_chunks(run_id)))


def parse_lines(lines: list[str]) -> list[Record]:
    """The records of journal lines; a torn line (a writer killed mid-write) is none."""
    out = []
    for line in lines:
        try:
            record = parse_record(json.loads(line))
        except ValueError:
            continue
        if record is not None:
            out.append(record)
    return out


class LedgerJournal:
    """``writer``'s journal of ``run_id``'s records under ``state_dir`` (module doc)."""

    def __init__(self, run_id: str, writer: str, repo: Repository, state_dir: Path) -> None:
        self.run_id, self.writer, self.repo = run_id, writer, repo
        self.log = get_logger(run=run_id)
        self.dir = state_dir / "goodput"
        self.path = self.dir / f"{run_id}.jsonl"
        self.shipped_path = self.dir / f"{run_id}.shipped"
        self.seq = 0
        self.ship_lock = asyncio.Lock()
        self.journaled: list[Record] | None = None  # the journal's records, read once
        self.appended = 0  # records appended by this writer

    def next_id(self) -> str:
        self.seq += 1
        return f"{self.writer}:{self.seq}"

    def append(self, record: Record) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record.to_json(), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.journaled is not None:
            self.journaled.append(record)
        self.appended += 1

    def lines(self) -> list[str]:
        try:
            return self.path.read_text().splitlines()
        except OSError:
            return []

    def records(self) -> list[Record]:
        """The journal's records (read from disk once, then kept as appended)."""
        if self.journaled is None:
            self.journaled = parse_lines(self.lines())
        return list(self.journaled)

    def shipped(self) -> int:
        """How many of the journal's lines the store has."""
        try:
            return int(self.shipped_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    async def ship(self) -> None:
        """Write the unshipped journal lines to the store (module doc)."""
        async with self.ship_lock:
            lines = self.lines()
            done = self.shipped()
            records = parse_lines(lines[done:])
            if not records:
                return
            body = chunk_bytes(self.run_id, self.writer, records)
            try:
                await asyncio.to_thread(
                    self.repo.write_ledger_chunk, self.run_id, self.writer, done, body
                )
            except StorageError as exc:
                self.log.warning("goodput_ship_failed", error=str(exc))
                return
            try:
                tmp = self.shipped_path.with_suffix(".tmp")
                tmp.write_text(str(len(lines)))
                os.replace(tmp, self.shipped_path)
            except OSError as exc:
                # The state dir refuses the mark (read-only, full): the next ship sends
                # these records again under another key, and readers count them once.
                self.log.warning("goodput_ship_unmarked", error=str(exc))
