"""``ckptd check``: a watch dir's checkpoints against what the store has committed, as
``rclone check`` compares two trees.

Each name is one of:

- ``identical``: committed, every file the manifest names is here with its size and
  CRC-32C, nothing else is here that ckptd would ship, and every object the manifest
  names is in the store with its size (one listing of the slot);
- ``differs``: committed, but some file is missing here, of another size or content,
  or here and not in the manifest, or an object is missing from the store or of another
  size there (each named, with how);
- ``pruned``: here, committed from here once (this node's journal says so), and no
  longer in the store: remote retention removed it. No difference;
- ``only-local``: here, and not committed (still being written or shipped, or never
  shipped);
- ``only-in-store``: committed, and not here (local retention removed it, or another
  node saved it).

What this node committed is read from its journal (``<state dir>/journal.sqlite3``, the
``committed`` table), opened read-only: a running daemon's journal is never written.

"Here" is what the daemon would ship: the watch dir's children that may be checkpoints
(``ckptd.layouts.is_checkpoint_candidate``: no dot-names, no temporary names, no
symlinked checkpoint), and in each the regular files, a symlink to a regular file counted
as that file, less the scratch files no rule ships (``ckptd.layouts.base.SCRATCH_FILES``).
Sizes are compared first; only files of the manifest's size are read, in pieces, the
CRC-32C folded as they are read (``ckptd.runtime.file_checksum``). Nothing is written,
locally or in the store.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ckptd.commit.lineage import abandoned
from ckptd.core import checksum
from ckptd.core.manifest import Manifest
from ckptd.layouts import is_checkpoint_candidate
from ckptd.layouts.base import SCRATCH_FILES, basename, step_of
from ckptd.repository import FileProblem, Repository
from ckptd.runtime.file_checksum import file_crc32c
from ckptd.store.restore import is_single_file

State = Literal["identical", "differs", "pruned", "only-local", "only-in-store"]


@dataclass(frozen=True)
class CheckpointComparison:
    """One checkpoint name, here and in the store (module doc)."""

    name: str
    state: State
    files: int  # the manifest's files (committed) or the local ones (only-local)
    total_bytes: int
    problems: tuple[FileProblem, ...] = ()


def committed_here(state_dir: Path, run_id: str) -> set[str] | None:
    """The local names this node's journal records committed for ``run_id``; None when
    there is no journal there or it cannot be read (then nothing is told "pruned")."""
    path = state_dir / "journal.sqlite3"
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT checkpoint FROM committed WHERE run = ?", (run_id,))
            return {str(row[0]) for row in rows.fetchall()}
        finally:
            db.close()
    except sqlite3.Error:
        return None


def local_checkpoints(watch_dir: Path) -> list[str]:
    """The names under ``watch_dir`` that may be checkpoints, sorted; [] when it is absent."""
    names: list[str] = []
    try:
        entries = list(os.scandir(watch_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        try:
            if entry.is_symlink():
                continue  # never data: the daemon never follows one either
            is_dir = entry.is_dir(follow_symlinks=False)
            if not is_dir and not entry.is_file(follow_symlinks=False):
                continue
        except FileNotFoundError:
            continue
        if is_checkpoint_candidate(entry.name, is_dir):
            names.append(entry.name)
    return sorted(names)


def _walk(root: Path) -> Iterator[tuple[str, str]]:
    """``(relative path, absolute path)`` of each file under ``root``, directories not
    followed through symlinks."""
    for directory, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        rel = os.path.relpath(directory, root)
        for name in sorted(files):
            yield (name if rel == "." else f"{rel}/{name}"), os.path.join(directory, name)


def local_files(path: Path, name: str) -> dict[str, tuple[str, int]]:
    """What the daemon would ship of the checkpoint at ``path``: relative path ->
    (absolute path, size). A single-file checkpoint is the file ``name``."""
    if stat.S_ISREG(os.lstat(path).st_mode):
        return {name: (str(path), os.lstat(path).st_size)}
    found: dict[str, tuple[str, int]] = {}
    for rel, full in _walk(path):
        if basename(rel) in SCRATCH_FILES:
            continue
        try:
            st = os.stat(full)  # a symlink to a regular file counts as that file
        except OSError:
            continue  # dangling: the daemon would not ship it
        if stat.S_ISREG(st.st_mode):
            found[rel] = (full, st.st_size)
    return found


def _crc_or_error(item: tuple[str, str, str]) -> int | OSError:
    try:
        return file_crc32c(item[1])
    except OSError as exc:
        return exc


def store_problems(repo: Repository, manifest: Manifest) -> list[FileProblem]:
    """The objects ``manifest`` names that the store lacks or holds at another size."""
    return [
        FileProblem(
            m.path,
            "missing in the store"
            if m.found is None
            else f"{m.found} bytes in the store, {m.expected} in the manifest",
        )
        for m in repo.object_mismatches(manifest)
    ]


def compare_checkpoint(
    path: Path, manifest: Manifest, pool: ThreadPoolExecutor
) -> list[FileProblem]:
    """How the checkpoint at ``path`` differs from ``manifest``, file by file."""
    if is_single_file(manifest) != stat.S_ISREG(os.lstat(path).st_mode):
        what = "a file" if is_single_file(manifest) else "a directory"
        return [FileProblem("", f"the store has {what} by this name, and here it is not")]
    here = local_files(path, manifest.checkpoint)
    problems: list[FileProblem] = []
    to_read: list[tuple[str, str, str]] = []  # (path, local path, the manifest's CRC)
    for f in manifest.files:
        local = here.get(f.path)
        if local is None:
            problems.append(FileProblem(f.path, "missing here"))
        elif local[1] != f.size:
            problems.append(FileProblem(f.path, f"{local[1]} bytes here, {f.size} in the store"))
        else:
            to_read.append((f.path, local[0], f.crc32c))
    for (rel, _, expected), crc in zip(to_read, pool.map(_crc_or_error, to_read), strict=True):
        if isinstance(crc, OSError):
            problems.append(FileProblem(rel, f"cannot be read here: {crc.strerror or crc}"))
        elif (found := checksum.to_hex(crc)) != expected:
            problems.append(
                FileProblem(rel, f"content differs: CRC-32C {found} here, {expected} in the store")
            )
    named = manifest.file_map()
    problems += [FileProblem(p, "here, and not in the manifest") for p in here if p not in named]
    return sorted(problems, key=lambda p: p.path)


def _order(name: str) -> tuple[int, str]:
    step = step_of(name)
    return (step if step is not None else -1, name)


def compare_run(
    repo: Repository,
    run_id: str,
    watch_dir: Path,
    *,
    concurrency: int = 8,
    committed: set[str] | None = None,
) -> list[CheckpointComparison]:
    """Every checkpoint name of ``run_id``, here (``watch_dir``) or committed, by step. A
    name with several committed contents (a rollback's slots, ``ckptd.commit.slots``) is
    identical when the local copy is any of them, the live trajectory's tried first, and
    its objects are all in the store; a content only in the store is named by its slot.
    ``committed``: the names this node committed (``committed_here``), so that one
    retention removed from the store is ``pruned``, not ``only-local``."""
    listed = repo.list_committed(run_id)
    latest = next((c.manifest.checkpoint for c in listed if c.is_latest), None)
    off_line = abandoned((c.manifest for c in listed), latest)
    by_name: dict[str, list[Manifest]] = {}
    for c in sorted(listed, key=lambda c: c.manifest.checkpoint in off_line):
        by_name.setdefault(c.manifest.local_name, []).append(c.manifest)
    local = local_checkpoints(watch_dir)
    found: list[CheckpointComparison] = []
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for name in sorted(set(local) | set(by_name), key=_order):
            contents = by_name.get(name, [])
            if name in local and not os.path.lexists(watch_dir / name):
                local.remove(name)  # removed since the listing (the trainer's rotation)
            if not contents and name not in local:
                continue
            if not contents:
                files = local_files(watch_dir / name, name)
                size = sum(s for _, s in files.values())
                state: State = "pruned" if name in (committed or ()) else "only-local"
                found.append(CheckpointComparison(name, state, len(files), size))
            elif name not in local:
                for m in contents:
                    found.append(
                        CheckpointComparison(
                            m.checkpoint, "only-in-store", len(m.files), m.total_bytes
                        )
                    )
            else:
                found.append(_against_any(repo, watch_dir / name, name, contents, pool))
    return found


def _against_any(
    repo: Repository,
    local: Path,
    name: str,
    contents: list[Manifest],
    pool: ThreadPoolExecutor,
) -> CheckpointComparison:
    """The local copy against each committed content of its name, in order, until one is
    identical here and whole in the store; else the differences from the first."""
    first: list[FileProblem] | None = None
    for manifest in contents:
        problems = compare_checkpoint(local, manifest, pool)
        if not problems:
            problems = store_problems(repo, manifest)
        if not problems:
            return CheckpointComparison(
                name, "identical", len(manifest.files), manifest.total_bytes
            )
        first = problems if first is None else first
    head = contents[0]
    return CheckpointComparison(
        name, "differs", len(head.files), head.total_bytes, tuple(first or ())
    )


__all__ = [
    "CheckpointComparison",
    "committed_here",
    "compare_checkpoint",
    "compare_run",
    "local_checkpoints",
    "local_files",
    "store_problems",
]
