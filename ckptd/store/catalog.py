"""What a run's retention already knows about the store, so that a pass after a commit
costs the same after ten checkpoints as after ten thousand.

A committed manifest never changes (it is written once, ``If-None-Match: *``), so a
``RunCatalog`` reads each one once and keeps it; a name it has settled (a checkpoint it
deleted, an orphan it collected, a prefix some stores keep listing after its last object
went) costs nothing on later passes. Each pass (``refresh``):

- lists the run's names once (one request per 1,000 names) and forgets every name no
  longer listed;
- tells a withdrawn slot (``ckptd.commit.withdrawal``) from one without a manifest, from
  the same read, and keeps the withdrawal's time (read once, as a manifest is);
- reads the manifest of each name it has not seen yet, and again of each name it saw
  without one (an upload in flight may have committed since): in a steady run, the one
  checkpoint just committed (kept without its file list: ``kept``);
- checks the newest ``window`` committed manifests with a HEAD each (the ones whose
  presence decides what the count rule deletes): one gone is dropped, one whose
  ETag/size/checksum changed since the last check is read again;
- forgets what it knew of a checkpoint this daemon has just committed (``forget``), so
  a name retention once deleted and the trainer saved again is read afresh;
- every ``FULL_REFRESH_SECONDS`` starts from nothing and reads every manifest again, so
  a manifest deleted or replaced behind ckptd's back outside that window, or objects put
  under a prefix it settled, are noticed within a day.

What the catalog may get wrong between full refreshes errs on the side of keeping: a
checkpoint another node committed under a name this catalog settled is not counted (so
not deleted, and not among the newest, so more is kept); a manifest deleted outside the
window is still counted until it is planned for deletion, which then deletes nothing.
Before an orphan is collected its manifest is checked with a HEAD
(``ckptd.store.retention``), as without a catalog. ``ckptd list`` and restore never use
it: they read fresh.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptd.commit.slots import parse_withdrawal
from ckptd.core.manifest import Manifest, ManifestError, epoch_of_timestamp, parse_manifest
from ckptd.repository import LIST_CONCURRENCY, Repository, manifest_key
from ckptd.storage.base import ObjectInfo

# How often a catalog forgets everything and reads every manifest again (seconds).
FULL_REFRESH_SECONDS = 24 * 3600.0


@dataclass
class KnownManifest:
    """A committed manifest as read, without its file list (``kept``), and the store's
    identity of its object when last checked with a HEAD (None until the first check)."""

    manifest: Manifest
    identity: tuple[int, str, str] | None = None


def kept(manifest: Manifest) -> Manifest:
    """What the catalog keeps of a manifest: everything but its file list, which no
    retention rule reads. A manifest of 100,000 files is about 70 MiB as objects, and a
    catalog holds one per checkpoint it knows."""
    return manifest.model_copy(update={"files": []})


def identity_of(info: ObjectInfo) -> tuple[int, str, str]:
    """What tells one version of an object from another: size, ETag, checksum."""
    return (info.size, info.etag, info.checksum)


def _order(known: KnownManifest) -> tuple[int, str]:
    m = known.manifest
    return (m.step if m.step is not None else -1, m.committed_at)


class RunCatalog:
    """One run's names as retention last saw them (module doc). Not thread-safe by
    itself: a retention pass holds ``lock`` throughout."""

    def __init__(self, *, full_refresh_seconds: float = FULL_REFRESH_SECONDS) -> None:
        self.full_refresh_seconds = full_refresh_seconds
        self.lock = threading.Lock()
        self._to_forget: set[str] = set()  # set.add and set.pop are atomic: no lock
        self.committed: dict[str, KnownManifest] = {}
        # Listed names seen without a manifest: uploads in flight, orphans, junk.
        self.uncommitted: set[str] = set()
        # A manifest is there but does not parse (a newer ckptd's): never touched.
        self.unparsable: set[str] = set()
        # Among ``uncommitted``: a withdrawal stands at the manifest key
        # (``ckptd.commit.withdrawal``), by the epoch seconds it was made (None: not
        # readable). What is left of the slot can go at once; a withdrawal, like a
        # manifest, is read once.
        self.withdrawn: dict[str, float | None] = {}
        # Withdrawn slots emptied but for their withdrawal: nothing to do until it expires.
        self.emptied: set[str] = set()
        # Deleted or collected by retention: nothing left to do, even while still listed.
        self.settled: set[str] = set()
        self.refreshed_at: float | None = None
        self.manifest_reads = 0  # manifest GETs this catalog made, for tests and the bench

    def reset(self) -> None:
        self.committed.clear()
        self.uncommitted.clear()
        self.withdrawn.clear()
        self.emptied.clear()
        self.unparsable.clear()
        self.settled.clear()
        self.refreshed_at = None

    def settle(self, name: str) -> None:
        """``name`` was deleted (manifest and objects) or collected: nothing to do."""
        self.committed.pop(name, None)
        self.uncommitted.discard(name)
        self.withdrawn.pop(name, None)
        self.emptied.discard(name)
        self.settled.add(name)

    def forget(self, name: str) -> None:
        """Know nothing of ``name`` from the next pass on, which reads its manifest (one
        this daemon has just committed, perhaps under a name retention once deleted).
        Safe to call while a pass runs on another thread: it only notes the name."""
        self._to_forget.add(name)

    def _apply_forgotten(self) -> None:
        while self._to_forget:
            name = self._to_forget.pop()
            self.committed.pop(name, None)
            self.uncommitted.discard(name)
            self.withdrawn.pop(name, None)
            self.emptied.discard(name)
            self.unparsable.discard(name)
            self.settled.discard(name)

    def entries(self) -> list[Manifest]:
        """The committed manifests known, oldest first (by step, then commit time)."""
        return [k.manifest for k in sorted(self.committed.values(), key=_order)]

    def refresh(self, repo: Repository, run_id: str, *, now: float, window: int) -> None:
        """Bring the catalog up to date with the store at the cost the module doc gives."""
        if self.refreshed_at is None or now - self.refreshed_at >= self.full_refresh_seconds:
            self.reset()
            self.refreshed_at = now
        self._apply_forgotten()
        listed = {n for n in repo.list_names(run_id) if not n.startswith(".")}
        self._forget_unlisted(listed)
        unread = [
            n
            for n in sorted(listed)
            if n not in self.committed
            and n not in self.settled
            and n not in self.unparsable
            and n not in self.withdrawn
        ]
        self._read(repo, run_id, unread)
        self._check_newest(repo, run_id, window)

    def _forget_unlisted(self, listed: set[str]) -> None:
        for names in (self.uncommitted, self.emptied, self.unparsable, self.settled):
            names.intersection_update(listed)
        for name in [n for n in self.withdrawn if n not in listed]:
            del self.withdrawn[name]
        for name in [n for n in self.committed if n not in listed]:
            del self.committed[name]

    def _read(self, repo: Repository, run_id: str, names: Iterable[str]) -> None:
        todo = list(names)
        if not todo:
            return
        with ThreadPoolExecutor(max_workers=LIST_CONCURRENCY) as pool:
            bodies = list(pool.map(lambda n: repo.read_manifest_bytes(run_id, n), todo))
        self.manifest_reads += len(todo)
        for name, body in zip(todo, bodies, strict=True):
            self.uncommitted.discard(name)
            withdrawal = parse_withdrawal(body) if body is not None else None
            if body is None or withdrawal is not None:
                self.committed.pop(name, None)
                self.uncommitted.add(name)
                if withdrawal is not None:
                    self.withdrawn[name] = epoch_of_timestamp(withdrawal.withdrawn_at)
                continue
            try:
                self.committed[name] = KnownManifest(kept(parse_manifest(body)))
            except ManifestError:
                self.committed.pop(name, None)
                self.unparsable.add(name)

    def _check_newest(self, repo: Repository, run_id: str, window: int) -> None:
        newest = sorted(self.committed.items(), key=lambda kv: _order(kv[1]))[-max(1, window) :]
        changed: list[str] = []
        for name, known in newest:
            info = repo.storage.head(manifest_key(run_id, name))
            if info is None:
                del self.committed[name]
                self.uncommitted.add(name)
            elif known.identity is None:
                known.identity = identity_of(info)
            elif known.identity != identity_of(info):
                changed.append(name)
        self._read(repo, run_id, changed)


__all__ = ["FULL_REFRESH_SECONDS", "KnownManifest", "RunCatalog", "identity_of", "kept"]
