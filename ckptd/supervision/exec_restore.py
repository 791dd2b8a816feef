"""``ckptd exec``'s restore before the trainer's first start, in steps: the newest
committed checkpoint in any tier (``newest_committed``), whether a complete local one is
as new (``local_is_as_new``, ``restore_needed``), a part of that very checkpoint already
in its place (a survivor's own files of a many-node one) set aside to be replaced by the
whole, never written into (``set_aside_a_part``), and the restore itself into the watch
dir, from peers first when they hold it (``restore_into``). ``SupervisedService.restore_newest``
(``ckptd.supervision.exec_service``) runs them in that order, once the live line says a
restore may run at all.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptd.config import Settings
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import Manifest, ManifestError
from ckptd.peers.restore import restore_with_peers
from ckptd.storage import StorageError
from ckptd.storage.base import NotFoundError
from ckptd.store.nearby import SHOWN, where_runs_are
from ckptd.store.restore import RestoreError, RestoreRequest
from ckptd.store.restore.in_place import is_part_of, local_problems
from ckptd.store.tiers import TierRestore, TierStore, newest_in_tiers


class ExecError(CkptdError):
    """``ckptd exec`` cannot start the trainer safely (exit 1)."""


async def newest_committed(
    stores: Sequence[TierStore], run_id: str, local_path: Path | None, log: Any
) -> Manifest | None:
    """The newest committed checkpoint of ``run_id`` in any tier (from the first holding
    it), or None when no tier holds one: a new run, or a typo'd prefix or run id, which
    looks the same, so what the store holds instead is said, loudly (``ckptd.store.nearby``).
    ExecError when the store cannot say what it holds: starting the trainer from scratch
    would train over the run's history."""
    try:
        manifest, _ = await asyncio.to_thread(newest_in_tiers, stores, run_id, log)
    except NotFoundError:
        first = stores[0]
        hint = await asyncio.to_thread(where_runs_are, first.storage, first.config, run_id)
        if hint.message:
            log.warning(
                "exec_nothing_to_restore",
                run=run_id,
                local=str(local_path),
                hint=hint.message,
                runs=list(hint.runs[:SHOWN]),
                beside=list(hint.beside),
                fix="check --dest and --run: the trainer starts from scratch",
            )
        else:
            log.info("exec_nothing_to_restore", run=run_id, local=str(local_path))
        return None
    except (StorageError, ManifestError) as exc:
        raise ExecError(
            f"cannot read run {run_id!r} from {stores[0].storage.url}: {exc}; "
            "fix the destination (or run the trainer without ckptd exec)"
        ) from exc
    return manifest


def local_is_as_new(local_path: Path | None, local_step: int | None, manifest: Manifest) -> bool:
    """Whether the complete local checkpoint (``local_path`` at ``local_step``) is the
    committed one, or of as high a step: then nothing is restored. (One of the committed
    one's name holding only part of its files is set aside first: ``set_aside_a_part``.)"""
    if local_path is None:
        return False
    if local_path.name == manifest.local_name:
        return True
    return local_step is not None and manifest.step is not None and local_step >= manifest.step


def restore_needed(
    local_path: Path | None,
    local_step: int | None,
    manifest: Manifest,
    watch_dir: Path,
    log: Any,
) -> tuple[bool, Path | None]:
    """Whether ``manifest``'s checkpoint must be restored into ``watch_dir``, given the
    newest complete local one (``local_path`` at ``local_step``), and where a part of it
    that was in its place was set aside for that (``set_aside_a_part``; its files are
    read once). Blocking."""
    same_name = local_path is not None and local_path.name == manifest.local_name
    if not same_name and local_is_as_new(local_path, local_step, manifest):
        return False, None
    aside = set_aside_a_part(watch_dir / manifest.local_name, manifest, log)
    # The committed one itself, whole, is as new; one set aside is restored whole.
    return not (same_name and aside is None), aside


def set_aside_a_part(final: Path, manifest: Manifest, log: Any) -> Path | None:
    """Move ``final`` (``DIR/NAME``) out of the way when it holds part of ``manifest``'s
    checkpoint and nothing else (``is_part_of``: node 0's shards and DCP's ``.metadata``
    of a many-node checkpoint, complete by the local rule), so the restore can put the
    whole in its place; its new path, or None when there is nothing to set aside
    (absent, whole, or holding anything else: the restore refuses that one, naming it).
    Blocking (a part's files are read, once)."""
    if not os.path.lexists(final) or not local_problems(final, manifest):
        return None
    if not is_part_of(final, manifest):
        return None
    aside = final.with_name(f".ckptd-part-{final.name}")
    if os.path.lexists(aside):
        shutil.rmtree(aside)  # an earlier attempt's: files of the committed checkpoint only
    os.rename(final, aside)
    log.info("exec_restore_completes_a_part", path=str(final), kept_aside=str(aside))
    return aside


async def restore_into(
    settings: Settings,
    stores: Sequence[TierStore],
    run_id: str,
    manifest: Manifest,
    watch_dir: Path,
    *,
    aside: Path | None,
    log: Any,
) -> TierRestore:
    """Restore ``manifest``'s checkpoint of ``run_id`` into ``watch_dir``, from peers first
    when they hold any of it (replicas, and the other nodes restoring it), else from the
    first tier whose copy verifies; then delete ``aside`` (a part of it that was in its
    place, ``set_aside_a_part``), or put it back when the restore fails. ExecError when
    no copy verifies."""
    final = watch_dir / manifest.local_name
    request = RestoreRequest(
        run_id,
        manifest.checkpoint,
        watch_dir,
        if_missing=True,
        concurrency=settings.destination.concurrency,
        progress=False,
        # Authenticated checkpoints: refused before the trainer loads a byte.
        keys=settings.authentication.key_ring(),
    )
    try:
        done, _ = await asyncio.to_thread(
            functools.partial(restore_with_peers, settings, stores, request, log)
        )
    except BaseException as exc:
        if aside is not None and not os.path.lexists(final):
            await asyncio.to_thread(os.rename, aside, final)
        if isinstance(exc, RestoreError | StorageError | ManifestError):
            raise ExecError(f"restore of {run_id}/{manifest.checkpoint} failed: {exc}") from exc
        raise
    if aside is not None:
        await asyncio.to_thread(shutil.rmtree, aside, True)
    return done


def restored_status(done: TierRestore) -> dict[str, Any]:
    """``/v1/status``'s ``trainer.restored`` (and the ``exec_restored`` event's fields)."""
    result = done.result
    return {
        "checkpoint": result.checkpoint,
        "skipped": result.skipped,
        "seconds": round(result.seconds, 3),
        "bytes": result.total_bytes,
        "tier": done.tier,
        "peer_bytes": done.peer_bytes,
        "store_bytes": done.store_bytes,
    }
