"""Verified, atomic restore: a committed checkpoint appears as ``DIR/NAME`` whole, or not at all.

Split as restic's restorer is:

- ``procedure``: ``restore()``, the order (resolve the manifest, check the objects, stage,
  download, verify, rename into place) and why;
- ``request``: what a restore is asked (``RestoreRequest``), what it did, how it fails;
- ``staging``: the hidden staging dir, its no-follow tree and its state log;
- ``download``: the ranged, parallel download and its checks as the bytes are written;
- ``progress``: the bar on a terminal, the log line elsewhere;
- ``in_place``: the sizes-only check behind ``--if-missing``;
- ``target``: ``DIR`` made, opened and found writable, or refused in one line.
"""

from __future__ import annotations

from ckptd.repository import chunk_ranges
from ckptd.store.restore.in_place import local_problems
from ckptd.store.restore.procedure import environment_differences, part_manifest, restore
from ckptd.store.restore.request import RestoreError, RestoreRequest, RestoreResult
from ckptd.store.restore.staging import (
    STAGING_PREFIX,
    is_single_file,
    manifest_identity,
    staged_parts,
)

__all__ = [
    "STAGING_PREFIX",
    "RestoreError",
    "RestoreRequest",
    "RestoreResult",
    "chunk_ranges",
    "environment_differences",
    "is_single_file",
    "local_problems",
    "manifest_identity",
    "part_manifest",
    "restore",
    "staged_parts",
]
