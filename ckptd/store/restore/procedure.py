"""Verified, atomic restore: a committed checkpoint appears as ``DIR/NAME`` whole, or not at all.

The order, and why:

1. resolve the manifest (``--latest``: LATEST, else the newest committed one) and check
   it names only safe relative paths (``ckptd.core.manifest`` rejects absolute paths, ``..``,
   empty components; a manifest that does not parse is a ``ManifestError``);
2. list the checkpoint's objects once: one that is missing or of another size than the
   manifest says (larger included) refuses the restore before a byte is written;
3. download into a hidden staging dir beside the target, ``DIR/.ckptd-restore-NAME/``
   (``ckptd.store.restore.staging``): ranged GETs in parallel, each file held to the
   manifest's size and CRC-32C as it is written (``ckptd.store.restore.download``); a
   file that differs is deleted, never kept;
4. make every file, inode and directory durable (one ``syncfs`` of the staging
   filesystem, or an ``fsync`` of each where that is not to be trusted:
   ``ckptd.store.restore.durability``), then rename ``staging/data`` to ``DIR/NAME``
   (one ``rename(2)`` inside ``DIR``) and fsync ``DIR``.

``DIR`` is made if need be before step 2, and found writable before step 3; one that
cannot be a writable directory is refused in one line naming it and the fix, with
nothing written (``ckptd.store.restore.target``).

So a failed or interrupted restore leaves nothing at ``DIR/NAME``: the staging module
says what it does leave (verified files only) and what a rerun reuses.

``if_missing`` (``restore --latest --to DIR --if-missing``) returns at once when
``DIR/NAME`` exists and every manifest file is there, a regular file (no symlink on the
way) of the manifest's size: sizes only, no re-hash, so it costs two small GETs (LATEST,
manifest) and some ``lstat``s; the bytes were verified when it was restored. It also
removes the staging dir a restore killed between its rename and its clean-up left beside
``DIR/NAME``. Restores into one ``DIR`` take turns (``flock`` on ``DIR``): the ranks of a
node that all ask for the same checkpoint at start-up cause one download.

A checkpoint committed by many nodes is restored whole by default (DCP and ZeRO loaders
read shards other ranks wrote). ``part=RANK`` restores only the files of that node's part
(``ckptd.part-<rank>.json``), each of which must be in the global manifest with the same
size and CRC-32C; the global manifest's entries are what is downloaded and verified.

Authenticated checkpoints (``keys``, from ``[authentication]``): before anything is
written the manifest's signature must hold (``KeyRing.check``: unsigned, unknown key id
or altered is refused), and each file's bytes are held to its digest as they are
written, from the same buffers as the CRC-32C, in 1 MiB blocks (ranges start on a
block, so each range's digests fold into the file's: ``ckptd.core.digest``). A file whose
digest differs is deleted like one whose CRC-32C does, so nothing unverified is ever
renamed into place. Without ``keys`` the digests a manifest carries are not checked:
without a key they prove nothing a CRC-32C does not (an attacker rewrites both).

While it runs, a restore holds a lease (``ckptd.repository``) so retention on another
node does not delete the checkpoint under it; taking it is best effort (a node with
read-only credentials restores without one).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptd.commit import objects
from ckptd.core import digest
from ckptd.core.manifest import Manifest, ManifestError, check_relative_path
from ckptd.repository import FileProblem, Repository, redirect_target
from ckptd.storage.base import Storage, StorageError
from ckptd.store.restore.download import download
from ckptd.store.restore.durability import Durability
from ckptd.store.restore.in_place import local_problems
from ckptd.store.restore.record import record_restore
from ckptd.store.restore.request import RestoreError, RestoreRequest, RestoreResult
from ckptd.store.restore.staging import (
    STAGING_PREFIX,
    StagingTree,
    StateLog,
    discard_leftover,
    finalise,
    first_outside,
    manifest_identity,
    open_staging,
    staged_bytes,
    staged_parts,
    still_to_fetch,
)
from ckptd.store.restore.target import open_target, require_writable

# Versions that decide whether a checkpoint loads (and loads the same) on this node.
ENVIRONMENT_KEYS = ("python", "torch", "cuda", "transformers", "lightning", "deepspeed", "jax")


def restore(
    storage: Storage, request: RestoreRequest, *, manifest: Manifest | None = None
) -> RestoreResult:
    """Restore what ``request`` names from ``storage`` as ``target_dir/NAME`` (module doc).
    ``manifest``: the one ``request`` names, already read from ``storage`` by the caller
    (a manifest of 100,000 files is a 9 MiB GET and a second of parsing); None: read here.

    Raises ManifestError (no valid manifest), StorageError (the store failed) or
    RestoreError (an object missing, of the wrong size or content; ``DIR/NAME`` exists
    and does not match; a local I/O error). With ``keys``, an AuthenticationError (a
    ManifestError) before anything is written if the signature does not hold.
    """
    from ckptd.runtime import logs

    if request.concurrency < 1 or request.chunk_bytes < 1:
        raise ValueError("concurrency and chunk_bytes must be >= 1")
    started, began_at = time.monotonic(), time.time()
    repo = Repository(storage)
    if manifest is None:
        manifest = repo.resolve(request.run_id, request.checkpoint)
    _check_manifest(repo, manifest, request.run_id, request.checkpoint)
    if request.keys is not None:
        request.keys.check(manifest)  # the whole signed manifest, before a part narrows it
        request = dataclasses.replace(
            request, chunk_bytes=digest.aligned_chunk(request.chunk_bytes)
        )
    if request.part is not None:
        manifest = part_manifest(repo, manifest, request.part)
    log = logs.get_logger(run=request.run_id, checkpoint=manifest.local_name)
    differences = _environment_check(manifest, request.environment, log)
    target_fd, target_real = open_target(request.target_dir)
    final = Path(target_real) / manifest.local_name
    try:
        _lock(target_fd, log)
        counts = _restore_locked(
            repo, manifest, request, target_fd, target_real, log, began_at=began_at
        )
        if counts is None:
            return _result(manifest, final, started, differences, 0, 0, skipped=True)
    finally:
        os.close(target_fd)  # also drops the lock
    downloaded, reused = counts
    out = _result(manifest, final, started, differences, downloaded, reused, skipped=False)
    log.info(
        "restore_done",
        path=str(final),
        files=out.files,
        bytes=out.total_bytes,
        downloaded_bytes=downloaded,
        reused_bytes=reused,
        seconds=round(out.seconds, 3),
        mib_per_s=round(downloaded / max(out.seconds, 1e-9) / 2**20, 1),
    )
    return out


def _restore_locked(
    repo: Repository,
    manifest: Manifest,
    request: RestoreRequest,
    target_fd: int,
    target_real: str,
    log: Any,
    *,
    began_at: float,
) -> tuple[int, int] | None:
    """Steps 2 to 4 under the lock on ``DIR``; returns (bytes downloaded, bytes reused),
    or None when ``if_missing`` found the checkpoint in place."""
    name = manifest.local_name
    final = Path(target_real) / name
    lease: str | None = None
    try:
        if os.path.lexists(final):
            problems = local_problems(final, manifest)
            if request.if_missing and not problems:
                discard_leftover(target_fd, name, log)
                log.info("restore_skipped", path=str(final), reason="present, sizes match")
                return None
            raise RestoreError(
                f"{final} already exists"
                + (" and differs from the manifest" if problems else "")
                + ": remove it first (ckptd never writes into an existing checkpoint)",
                problems,
            )
        require_writable(target_real)
        problems = _preflight(repo, manifest)
        if problems:
            raise RestoreError(
                f"{request.run_id}/{name}: {len(problems)} object(s) do not match the "
                "manifest; nothing was written",
                problems,
            )
        _check_free_space(target_real, manifest, name)
        if request.take_lease:
            try:
                lease = repo.take_lease(request.run_id, manifest.checkpoint, now=time.time())
            except StorageError as exc:
                log.warning("restore_lease_not_taken", error=str(exc))
        return _restore_into(
            repo.storage, manifest, request, target_fd, target_real, log, began_at=began_at
        )
    # Info, not error: whoever called says the failure (the CLI's one line, ckptd
    # exec's error); an error here would say it twice.
    except OSError as exc:
        log.info("restore_failed", error=str(exc))
        raise RestoreError(f"local I/O error under {target_real}: {exc}") from exc
    except (RestoreError, StorageError) as exc:
        log.info("restore_failed", error=str(exc))
        raise
    finally:
        if lease is not None:
            try:
                repo.release_lease(lease)
            except StorageError as exc:
                log.warning("restore_lease_not_released", key=lease, error=str(exc))


def _restore_into(
    storage: Storage,
    manifest: Manifest,
    request: RestoreRequest,
    target_fd: int,
    target_real: str,
    log: Any,
    *,
    began_at: float,
) -> tuple[int, int]:
    """Steps 3 and 4 of the module doc; returns (bytes downloaded, bytes reused)."""
    name = manifest.local_name
    identity = manifest_identity(manifest, digests=request.keys is not None)
    staging_fd, records = open_staging(target_fd, name, identity, log)
    tree = StagingTree(staging_fd)
    # Belt and braces (the descriptors already refuse symlinks): every path must
    # stay inside the staging dir after realpath, checked before any file is made.
    staging_path = os.path.join(target_real, STAGING_PREFIX + name)
    outside = first_outside(staging_path, [staged_parts(manifest, f.path) for f in manifest.files])
    if outside is not None:
        tree.close()
        path = manifest.files[outside].path
        raise ManifestError(f"unsafe path {path!r}: resolves outside {target_real}")
    try:
        state = StateLog(staging_fd, identity, fresh=records is None)
        try:
            durable = Durability(
                staging_fd, state, request.on_file, on_verified=request.on_verified
            )
            mtime_ns = time.time_ns()  # every restored file's (``finalise``)
            todo, reused = still_to_fetch(manifest, tree, records)
            if reused:
                log.info(
                    "restore_resumed",
                    reused_files=len(manifest.files) - len(todo),
                    reused_bytes=reused,
                )
                if request.on_verified is not None:  # verified by an earlier attempt
                    fetching = {f.path for f in todo}
                    for f in manifest.files:
                        if f.path not in fetching:
                            request.on_verified(f.path)
            downloaded = download(
                storage,
                manifest,
                todo,
                tree,
                durable,
                request,
                reused=reused,
                fresh=records is None,
                mtime_ns=mtime_ns,
                log=log,
            )
            finalise(manifest, tree, target_fd, name, durable.seal, mtime_ns)
        finally:
            state.close()
    finally:
        tree.close()
    # The checkpoint is in place; the staging dir holds only state.jsonl now.
    shutil.rmtree(STAGING_PREFIX + name, dir_fd=target_fd)
    os.fsync(target_fd)
    record_restore(target_fd, manifest, mtime_ns, log, began_at=began_at)
    return downloaded, reused


# -- the checks before a byte is written ---------------------------------------------------


def _check_manifest(
    repo: Repository, manifest: Manifest, run_id: str, checkpoint: str | None
) -> None:
    # The model validated every path on parsing; these say the manifest is the one asked for
    # (under the slot asked for, or the one a redirect there names).
    if manifest.run_id != run_id:
        raise ManifestError(f"manifest names run {manifest.run_id!r}, expected {run_id!r}")
    if (
        checkpoint is not None
        and manifest.checkpoint != checkpoint
        and redirect_target(repo.read_manifest_bytes(run_id, checkpoint) or b"")
        != manifest.checkpoint
    ):
        raise ManifestError(
            f"manifest names checkpoint {manifest.checkpoint!r}, expected {checkpoint!r}"
        )
    for f in manifest.files:
        check_relative_path(f.path)


def part_manifest(repo: Repository, manifest: Manifest, rank: int) -> Manifest:
    """``manifest`` narrowed to node ``rank``'s part, checked against it (module doc)."""
    where = f"{manifest.run_id}/{manifest.checkpoint}"
    if manifest.nodes is None:
        raise RestoreError(
            f"{where} was committed by one node and has no part {rank}: restore it whole"
        )
    if not 0 <= rank < manifest.nodes:
        raise RestoreError(
            f"{where} has no part {rank}: it was committed by nodes 0..{manifest.nodes - 1}"
        )
    part = objects.read_part(repo, manifest.run_id, manifest.checkpoint, rank)
    if part is None or part.save != manifest.save:
        raise RestoreError(f"{where} has no part {rank} of the committed save {manifest.save}")
    committed = manifest.file_map()
    problems = [
        FileProblem(f.path, "not in the global manifest, or with other content")
        for f in part.files
        if (g := committed.get(f.path)) is None or (g.size, g.crc32c) != (f.size, f.crc32c)
    ]
    if problems:
        raise RestoreError(f"{where}: part {rank} disagrees with the global manifest", problems)
    files = [committed[f.path] for f in part.files]
    return manifest.model_copy(update={"files": files, "total_bytes": sum(f.size for f in files)})


def environment_differences(
    recorded: Mapping[str, str], here: Mapping[str, str], keys: Sequence[str] = ENVIRONMENT_KEYS
) -> dict[str, tuple[str, str | None]]:
    """``key -> (version in the manifest, version here or None)`` where they differ."""
    return {
        key: (recorded[key], here.get(key))
        for key in keys
        if key in recorded and recorded[key] != here.get(key)
    }


def _environment_check(
    manifest: Manifest, environment: Mapping[str, str] | None, log: Any
) -> dict[str, tuple[str, str | None]]:
    """The versions that differ from the checkpoint's, said once as a warning: a restore
    still goes ahead (the trainer decides whether it loads)."""
    from ckptd.runtime.environment import describe

    differences = environment_differences(
        manifest.environment, describe() if environment is None else environment
    )
    if differences:
        log.warning(
            "restore_environment_differs",
            differences={k: {"checkpoint": a, "here": b} for k, (a, b) in differences.items()},
        )
    return differences


def _preflight(repo: Repository, manifest: Manifest) -> list[FileProblem]:
    """Objects missing or of another size than the manifest says: refused before a byte
    is written."""
    problems: list[FileProblem] = []
    for m in repo.object_mismatches(manifest):
        if m.found is None:
            problems.append(FileProblem(m.path, "missing"))
        else:
            word = "larger" if m.found > m.expected else "smaller"
            problems.append(
                FileProblem(
                    m.path, f"object is {m.found} bytes, {word} than the manifest's {m.expected}"
                )
            )
    return problems


def _check_free_space(target_real: str, manifest: Manifest, name: str) -> None:
    """Refuse before the first byte when the target's filesystem cannot hold what is
    left to fetch: otherwise a large restore fails after filling the disk."""
    staging = os.path.join(target_real, f"{STAGING_PREFIX}{name}")
    needed = manifest.total_bytes - (staged_bytes(staging) if os.path.isdir(staging) else 0)
    fs = os.statvfs(target_real)
    free = fs.f_bavail * fs.f_frsize
    if needed > free:
        raise RestoreError(
            f"{target_real} has {_mib(free)} free, and {manifest.run_id}/{name} needs "
            f"{_mib(needed)} more: free space there or restore elsewhere (nothing was written)"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _lock(target_fd: int, log: Any) -> None:
    """Serialise restores into one DIR: eight ranks that each run ``restore --latest
    --if-missing`` get one download, and seven instant "present" answers."""
    try:
        fcntl.flock(target_fd, fcntl.LOCK_EX)
    except OSError as exc:  # some network filesystems lock no directories
        log.warning("restore_unlocked", error=str(exc))


def _result(
    manifest: Manifest,
    final: Path,
    started: float,
    differences: dict[str, tuple[str, str | None]],
    downloaded: int,
    reused: int,
    *,
    skipped: bool,
) -> RestoreResult:
    return RestoreResult(
        run_id=manifest.run_id,
        checkpoint=manifest.checkpoint,
        step=manifest.step,
        path=final,
        files=len(manifest.files),
        total_bytes=manifest.total_bytes,
        downloaded_bytes=downloaded,
        reused_bytes=reused,
        seconds=time.monotonic() - started,
        skipped=skipped,
        environment_differences=differences,
    )


__all__ = [
    "ENVIRONMENT_KEYS",
    "environment_differences",
    "part_manifest",
    "restore",
]
