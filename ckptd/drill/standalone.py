"""The restore-only drill (``ckptd drill --restore-only``): the drill's second half run by
itself, on any node that reaches the store, as a fresh node would resume the run.

No daemon and no notice: the run's newest committed checkpoint (or the one named) is
proved (``ckptd.drill.proof``: restored -> verified -> loaded) and the drill recorded
beside the run like any other, so the run's success rate, its gauges and its alert count
it. A store that refuses the record (read-only credentials) costs the record, never the
result: the drill's exit code and output still say what it found.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptd.core.signing import KeyRing
from ckptd.drill.model import DrillRecord, drill_id
from ckptd.drill.proof import ProofRequest, clear_stale, prove
from ckptd.repository import Repository
from ckptd.runtime.logs import get_logger
from ckptd.storage.base import Storage, StorageError


@dataclass(frozen=True)
class RestoreOnlyDrill:
    """What to prove: ``checkpoint`` of ``run_id`` (None: the newest committed), restored
    under ``scratch_root``, loaded by ``check`` within ``check_timeout`` seconds."""

    run_id: str
    checkpoint: str | None
    scratch_root: Path
    check: Sequence[str]
    check_timeout: float
    concurrency: int = 8
    keys: KeyRing | None = None


def run_restore_only(storage: Storage, drill: RestoreOnlyDrill) -> tuple[DrillRecord, str | None]:
    """Prove the checkpoint and record the drill; the record and its key (None: the
    store refused it, logged as ``drill_record_not_written``)."""
    host = socket.gethostname()
    started = time.time()
    identity = drill_id(started, host)
    clear_stale(drill.scratch_root)
    proof = prove(
        storage,
        ProofRequest(
            drill.run_id,
            drill.checkpoint,
            drill.scratch_root / identity,
            drill.check,
            drill.check_timeout,
            concurrency=drill.concurrency,
            keys=drill.keys,
        ),
    )
    record = DrillRecord(
        run_id=drill.run_id,
        drill_id=identity,
        kind="restore-only",
        trigger="command",
        node=host,
        started=started,
        finished=time.time(),
        stages=tuple(proof.stages),
        checkpoint=proof.checkpoint,
        total_bytes=proof.bytes,
        error=proof.error,
    )
    try:
        key: str | None = Repository(storage).write_drill_record(
            record.run_id, record.drill_id, record.to_bytes()
        )
    except StorageError as exc:
        get_logger(run=drill.run_id).warning("drill_record_not_written", error=str(exc))
        key = None
    return record, key


__all__ = ["RestoreOnlyDrill", "run_restore_only"]
