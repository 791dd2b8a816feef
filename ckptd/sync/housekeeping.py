"""After a commit: remote retention, then (opt-in) local cleanup.

A failure here is logged and never fails the commit that came before it. Checkpoints
this node has pending or in flight are protected from remote retention; locally, only
checkpoints committed by this daemon are ever deleted (``ckptd.store.retention`` says which).
"""

from __future__ import annotations

import asyncio
from collections.abc import Set
from pathlib import Path
from typing import Any

from ckptd.config import RetentionConfig
from ckptd.core.manifest import ManifestError
from ckptd.layouts.base import step_of
from ckptd.repository import Repository
from ckptd.storage.base import StorageError
from ckptd.store.catalog import RunCatalog
from ckptd.store.retention import apply_local_cleanup, apply_retention
from ckptd.sync.scanner import list_candidates


async def after_commit(
    repo: Repository,
    policy: RetentionConfig,
    run: str,
    watch_dir: Path,
    *,
    protected: Set[str],
    committed_here: Set[str],
    log: Any,
    cluster_grace_seconds: float | None = None,
    catalog: RunCatalog | None = None,
) -> list[str]:
    """Apply retention to ``run``; returns the local checkpoints deleted (if any).
    ``catalog`` is the run's, kept across passes (``ckptd.store.catalog``)."""
    try:
        deleted = await asyncio.to_thread(
            apply_retention,
            repo,
            run,
            keep_last=policy.keep_last,
            keep_every_steps=policy.keep_every_steps,
            keep_within=policy.keep_within_seconds,
            protected=protected,
            cluster_grace_seconds=cluster_grace_seconds,
            catalog=catalog,
        )
        if deleted:
            log.info("retention_deleted", deleted=deleted)
    except (StorageError, ManifestError) as exc:
        log.warning("retention_failed", error=str(exc))
    if policy.local_keep_last <= 0:
        return []
    try:
        names = await asyncio.to_thread(list_candidates, watch_dir)
        local = sorted(
            ((n, step_of(n)) for n in names),
            key=lambda e: (e[1] if e[1] is not None else -1, e[0]),
        )
        removed = await asyncio.to_thread(
            apply_local_cleanup,
            watch_dir,
            local,
            set(committed_here),
            local_keep_last=policy.local_keep_last,
        )
        if removed:
            log.info("local_cleanup_deleted", deleted=removed)
        return removed
    except OSError as exc:
        log.warning("local_cleanup_failed", error=str(exc))
        return []
