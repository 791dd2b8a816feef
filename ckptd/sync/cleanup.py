"""Putting the store back in order after uploads that will not complete.

Two moments call for it: start-up (``recover``: what a previous process left in the
journal) and a checkpoint that changed under its upload (``discard``). Both abort the
multipart uploads the journal knows of (and, for one created but never recorded, every
upload the store lists under its key). ``discard`` also deletes the objects already
sent, unless the checkpoint is committed (a race with another node, or with ourselves
before a crash): objects a manifest names are never deleted here. ``discard_vanished``
discards, at start-up, each uncommitted checkpoint the journal holds whose local files
are gone (deleted while no daemon ran, files sent early included).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckptd.core.manifest import ManifestError
from ckptd.repository import Repository, checkpoint_prefix, claim_key, manifest_key
from ckptd.storage.base import StorageError
from ckptd.sync.journal import Journal, UploadRecord
from ckptd.sync.transfer import abort_journalled_upload


def _local_file(dirs: Mapping[str, Path], rec: UploadRecord) -> Path | None:
    run_dir = dirs.get(rec.run)
    if run_dir is None:
        return None
    checkpoint = run_dir / rec.checkpoint
    # A file checkpoint (Lightning *.ckpt) is its own only file.
    return checkpoint / rec.path if checkpoint.is_dir() else checkpoint


def _can_resume(dirs: Mapping[str, Path], rec: UploadRecord) -> bool:
    local = _local_file(dirs, rec)
    if rec.upload_id is None or local is None:
        return False
    with contextlib.suppress(OSError):
        st = local.stat()
        return (st.st_size, st.st_mtime_ns) == (rec.size, rec.mtime_ns)
    return False


def _abort(repo: Repository, rec: UploadRecord) -> None:
    abort_journalled_upload(repo.storage, rec.key, rec.upload_id or None)


def recover(repo: Repository, journal: Journal, dirs: Mapping[str, Path], log: Any) -> None:
    """Keep the uploads that can resume (their file unchanged, not yet committed); abort
    the rest. ``dirs`` maps each watched run to its directory. Blocking."""
    for rec in journal.all_uploads():
        if _can_resume(dirs, rec) and not journal.is_committed(rec.run, rec.checkpoint):
            continue
        try:
            _abort(repo, rec)
            journal.forget_upload(rec.key)
            log.info("orphan_upload_aborted", run=rec.run, checkpoint=rec.checkpoint, key=rec.key)
        except StorageError as exc:
            log.warning("orphan_abort_failed", key=rec.key, error=str(exc))


def _committed_in(repo: Repository, run: str, slot: str) -> bool:
    """Whether ``slot`` holds a committed manifest (a redirect there is another writer's:
    the slot's objects are garbage; a manifest that does not parse: when unsure, keep)."""
    try:
        return repo.read_manifest(run, slot) is not None
    except ManifestError:
        return True


def discard(
    repo: Repository,
    journal: Journal,
    run: str,
    name: str,
    log: Any,
    *,
    whole_prefix: bool = False,
) -> None:
    """Abort ``run/name``'s uploads and delete what it sent, unless it is committed;
    then forget it in the journal. Only this node's slots are touched (``ckptd.commit
    .slots``: the ones it claimed, kept in the journal), never another writer's objects.
    ``whole_prefix`` (one node: a slot it claimed is this daemon's alone) deletes every
    object listed under such a slot, so an object that reached the store just before a
    crash, unjournalled, goes too; whatever stands at its manifest key (a manifest, or
    another writer's redirect) stays. The claims of the slots it emptied go last: those
    slots are free again. Blocking; a storage failure is logged."""
    try:
        for rec in journal.all_uploads():
            if rec.run == run and rec.checkpoint == name:
                _abort(repo, rec)
        slots = journal.slots_of(run, name)
        committed = {slot for slot in slots if _committed_in(repo, run, slot)}
        keys = {
            r.key
            for r in journal.objects_for(run, name).values()
            if not any(r.key.startswith(checkpoint_prefix(run, slot)) for slot in committed)
        }
        if whole_prefix:
            for slot in set(slots) - committed:
                keep = {manifest_key(run, slot)}
                keys.update(o.key for o in repo.list_objects(run, slot) if o.key not in keep)
        keys -= {manifest_key(run, slot) for slot in slots}
        # Its claims last: with no object left there, the slots are free again.
        keys -= {claim_key(run, slot) for slot in slots}
        repo.delete(sorted(keys))
        if whole_prefix:  # many nodes: the slot is the job's, its claim stays
            repo.delete(sorted(claim_key(run, slot) for slot in set(slots) - committed))
        journal.forget_checkpoint(run, name)
    except StorageError as exc:
        log.warning("abandon_cleanup_failed", error=str(exc))


def discard_vanished(
    repo: Repository,
    journal: Journal,
    dirs: Mapping[str, Path],
    keep: Callable[[str, str], bool],
    log: Any,
    *,
    whole_prefix: bool = False,
) -> None:
    """``discard`` every uncommitted checkpoint in the journal whose local checkpoint is
    gone, unless ``keep(run, name)`` (many nodes: its part is written). Blocking."""
    for run, name in sorted(journal.uncommitted()):
        run_dir = dirs.get(run)
        if run_dir is None or journal.is_committed(run, name):
            continue
        try:
            if os.path.lexists(run_dir / name) or keep(run, name):
                continue
        except StorageError as exc:
            log.warning("vanished_check_failed", run=run, checkpoint=name, error=str(exc))
            continue
        log.info("vanished_checkpoint_discarded", run=run, checkpoint=name)
        discard(repo, journal, run, name, log, whole_prefix=whole_prefix)
