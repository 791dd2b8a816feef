"""The check behind ``--if-missing``: does an existing ``DIR/NAME`` hold the manifest's files?

Sizes only keeps ``--if-missing`` instant on a multi-GiB checkpoint; contents were
verified when it was restored. Symlinks count as differences (never followed); extra
local files are ignored.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckptd.core.manifest import Manifest, ManifestFile
from ckptd.repository import FileProblem
from ckptd.store.restore.staging import is_single_file


def local_problems(path: Path, manifest: Manifest) -> list[FileProblem]:
    """How ``path`` (an existing ``DIR/NAME``) differs from the manifest, by sizes only."""
    if is_single_file(manifest):
        return _local_file_problem(path, [], manifest.files[0])
    if not _is_real_dir(str(path)):
        return [FileProblem("", "not a directory")]
    problems: list[FileProblem] = []
    for f in manifest.files:
        problems += _local_file_problem(path, f.path.split("/"), f)
    return problems


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)  # lstat: a symlink is not a dir here
    except OSError:
        return False


def _local_file_problem(root: Path, parts: list[str], entry: ManifestFile) -> list[FileProblem]:
    current = str(root)
    for part in parts[:-1]:
        current = os.path.join(current, part)
        if not _is_real_dir(current):
            return [FileProblem(entry.path, "missing (or a symlink on the way)")]
    if parts:
        current = os.path.join(current, parts[-1])
    try:
        st = os.lstat(current)
    except FileNotFoundError:
        return [FileProblem(entry.path, "missing")]
    if not stat.S_ISREG(st.st_mode):
        return [FileProblem(entry.path, "not a regular file")]
    if st.st_size != entry.size:
        return [FileProblem(entry.path, f"size {st.st_size}, manifest says {entry.size}")]
    return []


__all__ = ["local_problems"]
