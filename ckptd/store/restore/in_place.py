"""How an existing ``DIR/NAME`` compares with a manifest: does it hold the manifest's files
(``local_problems``, the check behind ``--if-missing``), and is it a part of that very
checkpoint (``is_part_of``)?

Sizes only keeps ``--if-missing`` instant on a multi-GiB checkpoint; contents were
verified when it was restored. Symlinks count as differences (never followed); extra
local files are ignored. ``is_part_of`` reads every file: it decides whether a
directory may be replaced by the whole checkpoint without losing a byte.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckptd.core import checksum
from ckptd.core.manifest import Manifest, ManifestFile
from ckptd.repository import FileProblem
from ckptd.runtime.file_checksum import file_crc32c
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


def is_part_of(path: Path, manifest: Manifest) -> bool:
    """Whether the directory ``path`` holds nothing but files the manifest names, each a
    regular file of its size and CRC-32C (and real directories on the way): a part of
    that very checkpoint, such as a node's own files of a many-node one kept across a
    restart, which the whole checkpoint replaces without losing anything."""
    if is_single_file(manifest) or not _is_real_dir(str(path)):
        return False
    expected = {f.path: f for f in manifest.files}
    for directory, dirs, files in os.walk(path, followlinks=False):
        if not all(_is_real_dir(os.path.join(directory, d)) for d in dirs):
            return False
        for name in files:
            full = os.path.join(directory, name)
            entry = expected.get(Path(full).relative_to(path).as_posix())
            st = os.lstat(full)
            if entry is None or not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                return False
            if checksum.to_hex(file_crc32c(full)) != entry.crc32c:
                return False
    return True


__all__ = ["is_part_of", "local_problems"]
