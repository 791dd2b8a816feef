"""The restore-only drill (``ckptd drill --restore-only``): the drill's second half run by
itself, on any node that reaches the store, as a fresh node would resume the run.

No daemon and no notice: the run's newest committed checkpoint (or the one named) is
proved (``ckptd.drill.proof``: restored -> verified -> loaded, and with ``resume_steps``
-> resumed) and the drill recorded beside the run like any other, so the run's success
rate, its gauges and its alerts count it. A store that refuses the record (read-only
credentials) costs the record, never the result: the drill's exit code and output still
say what it found.

Invariants: a run with no committed checkpoint (or a named checkpoint that is not
committed) is refused before anything is written (``NothingToDrillError``): there is
nothing to drill, and a record would make a run of a typo. A store that cannot be read
fails the drill at ``restored`` and is not written to: one wait for the dead store, not a
second for its record.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptd.core.errors import CkptdError
from ckptd.core.manifest import ManifestError
from ckptd.core.signing import KeyRing
from ckptd.drill.model import DrillRecord, StageResult, drill_id, not_reached
from ckptd.drill.proof import Proof, ProofRequest, clear_stale, prove
from ckptd.repository import Repository
from ckptd.runtime.logs import get_logger
from ckptd.storage.base import NotFoundError, Storage, StorageError


class NothingToDrillError(CkptdError):
    """The run has no committed checkpoint (or the one named is not committed): no drill,
    and no record (exit 1)."""


@dataclass(frozen=True)
class RestoreOnlyDrill:
    """What to prove: ``checkpoint`` of ``run_id`` (None: the newest committed), restored
    under ``scratch_root``, loaded by ``check`` within ``check_timeout`` seconds, and with
    ``resume_steps`` > 0 resumed by ``resume`` for that many steps."""

    run_id: str
    checkpoint: str | None
    scratch_root: Path
    check: Sequence[str]
    check_timeout: float
    concurrency: int = 8
    keys: KeyRing | None = None
    resume: Sequence[str] = ()
    resume_steps: int = 0
    resume_timeout: float = 1800.0


def run_restore_only(storage: Storage, drill: RestoreOnlyDrill) -> tuple[DrillRecord, str | None]:
    """Prove the checkpoint and record the drill; the record and its key (None: not
    written: the store was unreachable, or refused it, logged as
    ``drill_record_not_written``). NothingToDrillError when the run has nothing
    committed to drill."""
    host = socket.gethostname()
    started = time.time()
    identity = drill_id(started, host)
    request = ProofRequest(
        drill.run_id,
        drill.checkpoint,
        drill.scratch_root / identity,
        drill.check,
        drill.check_timeout,
        concurrency=drill.concurrency,
        keys=drill.keys,
        resume=drill.resume,
        resume_steps=drill.resume_steps,
        resume_timeout=drill.resume_timeout,
    )
    log = get_logger(run=drill.run_id)
    repo = Repository(storage)
    try:
        repo.resolve(drill.run_id, drill.checkpoint)
    except NotFoundError as exc:
        raise NothingToDrillError(f"nothing to drill: {exc}") from exc
    except ManifestError:
        pass  # committed, but its manifest does not read: the drill fails at restored
    except StorageError as exc:
        failed = StageResult(request.stages[0], "failed", time.time() - started, str(exc))
        unreachable = Proof(
            [failed, *not_reached(request.stages[1:])], drill.checkpoint, 0, str(exc)
        )
        log.warning("drill_record_not_written", error=f"the store is unreachable: {exc}")
        return _record(drill, identity, host, started, unreachable), None
    clear_stale(drill.scratch_root)
    record = _record(drill, identity, host, started, prove(storage, request))
    try:
        key: str | None = repo.write_drill_record(record.run_id, record.drill_id, record.to_bytes())
    except StorageError as exc:
        log.warning("drill_record_not_written", error=str(exc))
        key = None
    return record, key


def _record(
    drill: RestoreOnlyDrill, identity: str, host: str, started: float, proof: Proof
) -> DrillRecord:
    return DrillRecord(
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


__all__ = ["NothingToDrillError", "RestoreOnlyDrill", "run_restore_only"]
