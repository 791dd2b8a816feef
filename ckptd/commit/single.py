"""Making a checkpoint visible, in the one order that keeps the store honest.

    0. claim     ckptd.claim.json of the slot the writer ships into, create-only, before
                 any object (``claim_slot``; which slot: ``ckptd.commit.slots``)
    1. objects   every file uploaded (or copied) into that slot and verified against the
                 store's report of size and checksum      (ckptd.sync.transfer)
    2. manifest  ckptd.manifest.json, by a conditional write (If-None-Match: *) at the
                 name's canonical slot, or (a private slot) a redirect there first, then
                 the manifest in the slot (``commit``)
    3. LATEST    moved by ``ckptd.commit.lineage.moves_latest``: forward in step on the
                 live trajectory, or to a newer one

A crash between any two steps leaves either unreferenced objects in a slot this writer
claimed (collected later; a restart re-uses them, its claim being its own) or a committed
checkpoint that LATEST does not name yet: the restart that finds the manifest there runs
step 3 for it (``move_latest``), since ``restore --latest`` follows LATEST and would
otherwise resume from an older step. It never leaves a manifest naming an object that is
not there, nor a LATEST naming a checkpoint without a manifest.

Two writers of one name never share a slot, and only one create-only write commits a name
on a trajectory: the loser finds the winner's manifest (or redirect) and, unless the
contents are the same, gets ``CommitConflictError``, before or after shipping, with the
winner's bytes untouched either way (``ckptd.commit.slots`` states the invariants).
Blocking: run it in a thread.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ckptd.commit.lineage import moves_latest
from ckptd.commit.slots import (
    Claim,
    Redirect,
    Withdrawal,
    canonical_for,
    letters,
    parse_claim,
    parse_redirect,
    parse_withdrawal,
    private_slot,
    trajectory_slot,
)
from ckptd.commit.withdrawal import REDIRECT_GRACE_SECONDS, described, take_back
from ckptd.core import checksum
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import Latest, Manifest, ManifestError, parse_manifest, utc_timestamp
from ckptd.repository import Repository, claim_key, manifest_key, redirect_target
from ckptd.storage.base import PreconditionFailedError, Storage, StorageError


class CommitConflictError(CkptdError):
    """Another content holds this checkpoint's name on its trajectory: never overwritten.
    ``theirs`` says who holds it (host, writer, size, files) for the warning."""

    def __init__(self, message: str, theirs: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.theirs = theirs or {}


class SlotWithdrawnError(CommitConflictError):
    """The slot this writer shipped into was withdrawn (``ckptd rm --force``, retention,
    or the name's owner taking it back: ``ckptd.commit.withdrawal``): never committed,
    the local copy kept, said as a conflict is."""


def withdrawn_error(run: str, withdrawal: Withdrawal) -> SlotWithdrawnError:
    return SlotWithdrawnError(
        f"{run}/{withdrawal.checkpoint} was withdrawn by {withdrawal.by} on "
        f"{withdrawal.host} at {withdrawal.withdrawn_at} ({withdrawal.reason}) while this "
        "writer shipped it: not committed; the local copy is kept",
        described(withdrawal),
    )


Found = Manifest | Redirect | Withdrawal | None
"""What stands at a name's commit point (``committed_at``)."""


@dataclass(frozen=True)
class CommitResult:
    manifest_crc32c: str
    latest_moved: bool
    already_committed: bool
    manifest: Manifest  # what commits the name: the one written, or the same found there


@dataclass(frozen=True)
class Writer:
    """Who ships: one daemon's state (``Journal.writer``, kept across its restarts)."""

    id: str
    host: str
    node_rank: int | None = None


@dataclass(frozen=True)
class Slot:
    """Where one writer ships one content of a name (``ckptd.commit.slots``)."""

    name: str
    slot: str  # where its objects and manifest go
    canonical: str  # whose manifest key commits the name on ``trajectory``
    trajectory: str

    @property
    def private(self) -> bool:
        return self.slot != self.canonical


def same_content(a: Manifest, b: Manifest) -> bool:
    """Whether two manifests name the same files with the same bytes."""
    return [(f.path, f.size, f.crc32c) for f in a.files] == [
        (f.path, f.size, f.crc32c) for f in b.files
    ]


def holder(manifest: Manifest) -> dict[str, object]:
    """A committed content as a conflict's warning names it."""
    return {
        "slot": manifest.checkpoint,
        "host": manifest.host,
        "committed_at": manifest.committed_at,
        "files": len(manifest.files),
        "bytes": manifest.total_bytes,
        "trajectory": manifest.lineage.id,
    }


# -- step 0: the claim -------------------------------------------------------------------


def _private_tag(writer: Writer, name: str, trajectory: str) -> str:
    """The same for one writer, name and trajectory: a restart finds its own slot again."""
    digest = hashlib.sha256(f"{writer.id}\n{name}\n{trajectory}".encode()).digest()
    return letters(int.from_bytes(digest[:8], "big"))


def _claim_in_force(
    repo: Repository, run: str, slot: str, wanted: Claim
) -> tuple[Claim | None, bool]:
    """Create ``wanted`` at ``slot`` unless a claim is there: ``(the claim in force, whether
    it is ``wanted``'s writer's for this name and trajectory)``. A claim that does not
    parse is another writer's (None): when unsure, keep off."""
    try:
        repo.put_if_absent(claim_key(run, slot), wanted.to_bytes(), "claim a checkpoint's slot")
        return wanted, True
    except PreconditionFailedError:
        body = repo.get_or_none(claim_key(run, slot))
    if body is None:
        raise StorageError(
            f"claim {claim_key(run, slot)} vanished after a refused write", transient=True
        )
    try:
        found = parse_claim(body)
    except ManifestError:
        return None, False
    ours = (found.writer, found.name, found.trajectory) == (
        wanted.writer,
        wanted.name,
        wanted.trajectory,
    )
    return found, ours


@dataclass(frozen=True)
class Prepared:
    """What ``prepare_slot`` found: the slot to ship into, and what commits the name on
    the trajectory already. ``slot`` is None when that is another writer's manifest: the
    caller compares contents (the same: committed; else a conflict) and ships nothing."""

    slot: Slot | None
    committed: Found


def prepare_slot(
    repo: Repository, run: str, name: str, trajectory: str, writer: Writer, now: float
) -> Prepared:
    """Step 0: the slot this writer ships ``name``'s content on ``trajectory`` into, and
    what commits that name there already (``ckptd.commit.slots``). The canonical slot when
    its claim is (or becomes) this writer's; else, unless the name is committed there
    already, a private slot of its own, claimed. For a new name: one create-only write
    and one read of the canonical manifest key (the read a commit made before claims)."""

    def claim(slot: str, canonical: str) -> Claim:
        return Claim(
            run_id=run,
            checkpoint=slot,
            name=name,
            writer=writer.id,
            host=writer.host,
            claimed_at=utc_timestamp(now),
            trajectory=trajectory,
            canonical=canonical,
            node_rank=writer.node_rank,
        )

    # Read first, before any write: what stands at the home's manifest key (a store that
    # creates a bucket on a PUT, as SeaweedFS does, then still says a missing bucket is
    # missing), and, for a trajectory other than the home manifest's, where it commits.
    home = Slot(name, name, name, trajectory)
    found = committed_at(repo, run, home)
    canonical = name
    if isinstance(found, Manifest) and found.lineage.id != trajectory and found.local_name == name:
        canonical = trajectory_slot(name, trajectory)
    held, ours = _claim_in_force(repo, run, canonical, claim(canonical, canonical))
    if not ours and canonical == name and held is not None:
        other = canonical_for(name, trajectory, held, None)
        if other != name:
            canonical = other
            held, ours = _claim_in_force(repo, run, other, claim(other, other))
    base = Slot(name, canonical, canonical, trajectory)
    committed = found if canonical == name else committed_at(repo, run, base)
    if ours or isinstance(committed, Manifest):
        return Prepared(base if ours else None, committed)
    slot = private_slot(name, _private_tag(writer, name, trajectory))
    _, mine = _claim_in_force(repo, run, slot, claim(slot, canonical))
    if not mine:
        raise CommitConflictError(f"{run}/{slot} is claimed by another writer")
    return Prepared(Slot(name, slot, canonical, trajectory), committed)


def committed_at(repo: Repository, run: str, slot: Slot) -> Found:
    """What commits ``slot.name`` on its trajectory already: the manifest at the canonical
    slot (or the one its redirect names), a redirect whose manifest is not written yet
    (its writer is between the two writes), a withdrawal (of the canonical slot, or of
    this writer's own slot its redirect names), or None."""
    body = repo.read_manifest_bytes(run, slot.canonical)
    if body is None:
        return None
    withdrawal = parse_withdrawal(body)
    if withdrawal is not None:
        return withdrawal
    redirect = parse_redirect(body)
    if redirect is None:
        return parse_manifest(body)
    if redirect.to == slot.slot:  # ours, from before a restart: our slot's key, read once
        own = repo.read_manifest_bytes(run, slot.slot)
        if own is None or parse_redirect(own) is not None:
            return None
        withdrawn = parse_withdrawal(own)
        if withdrawn is not None:
            return withdrawn
        try:
            return parse_manifest(own)
        except ManifestError as exc:  # named as Repository.read_manifest names it
            raise ManifestError(f"{exc} (in {manifest_key(run, slot.slot)})") from None
    return repo.read_manifest(run, redirect.to) or redirect


# -- steps 2 and 3 -----------------------------------------------------------------------


def conflict(run: str, name: str, theirs: Found, why: str = "") -> CommitConflictError:
    """The error a writer gets when ``theirs`` holds its name on its trajectory."""
    where = f"{run}/{name}"
    if isinstance(theirs, Withdrawal):
        return withdrawn_error(run, theirs)
    if isinstance(theirs, Manifest):
        info = holder(theirs)
        text = (
            f"{where} is already committed with different content (slot {theirs.checkpoint}, "
            f"by {theirs.host}, {len(theirs.files)} files, {theirs.total_bytes} bytes)"
        )
    elif isinstance(theirs, Redirect):
        info = {"slot": theirs.to, "host": theirs.host, "writer": theirs.writer}
        text = f"{where} is being committed by {theirs.host} (slot {theirs.to})"
    else:
        info, text = {}, f"{where} is held by another writer"
    return CommitConflictError(f"{text}{': ' + why if why else ''}", info)


def _conflict(manifest: Manifest, theirs: Found) -> CommitConflictError:
    return conflict(manifest.run_id, manifest.local_name, theirs)


def _found(repo: Repository, theirs: Manifest) -> CommitResult:
    """The same content committed already (by this writer before a restart or a lost
    answer, or by another): LATEST moved if a crash left it behind."""
    stored = repo.read_manifest_bytes(theirs.run_id, theirs.checkpoint) or theirs.to_bytes()
    crc = checksum.crc32c(stored)
    return CommitResult(checksum.to_hex(crc), move_latest(repo, theirs, crc), True, theirs)


def _won_redirect(
    repo: Repository, manifest: Manifest, slot: Slot, writer: Writer, now: float
) -> bool:
    """A private slot's step 2a: write the redirect at the canonical slot's manifest key;
    whether this writer's redirect stands there (now, or from before a restart)."""
    redirect = Redirect(
        run_id=manifest.run_id,
        checkpoint=slot.canonical,
        name=slot.name,
        to=slot.slot,
        writer=writer.id,
        host=writer.host,
        redirected_at=utc_timestamp(now),
        trajectory=slot.trajectory,
    )
    key = manifest_key(manifest.run_id, slot.canonical)
    try:
        repo.put_if_absent(key, redirect.to_bytes(), "commit a checkpoint")
        return True
    except PreconditionFailedError:
        pass
    body = repo.get_or_none(key)
    return body is not None and redirect_target(body) == slot.slot


#: Attempts of the commit write at a canonical slot whose redirect keeps being taken back
#: (each take-back removes one cut-short redirect; a new one is another writer's race).
_TAKE_BACK_TRIES = 3


def writer_id(writer: Writer | None) -> str:
    return writer.id if writer is not None else "(unnamed)"


def take_back_name(
    repo: Repository,
    run: str,
    slot: Slot,
    redirect: Redirect,
    writer: Writer | None,
    now: float,
    wait_seconds: float | None = None,
) -> bool:
    """``take_back`` by this canonical slot's owner (``ckptd.commit.withdrawal``), after
    ``wait_seconds`` (None: ``REDIRECT_GRACE_SECONDS``)."""
    assert not slot.private, "only a canonical slot's owner takes a name back"
    return take_back(
        repo,
        run,
        slot.slot,
        redirect,
        by=f"writer {writer_id(writer)}",
        now=now,
        wait_seconds=REDIRECT_GRACE_SECONDS if wait_seconds is None else wait_seconds,
    )


def commit(
    storage: Storage | Repository,
    manifest: Manifest,
    slot: Slot | None = None,
    writer: Writer | None = None,
    *,
    now: float = 0.0,
) -> CommitResult:
    """Steps 2 and 3 above; the caller has done step 1 for every file in ``manifest``,
    whose ``checkpoint`` is ``slot.slot`` (without ``slot``: a slot of its own name).
    CommitConflictError when another content holds the name on its trajectory; the same
    content found there is committed already (``CommitResult.manifest`` is then that one)."""
    repo = storage if isinstance(storage, Repository) else Repository(storage)
    run = manifest.run_id
    if slot is None:
        slot = Slot(
            manifest.local_name, manifest.checkpoint, manifest.checkpoint, manifest.lineage.id
        )
    if slot.private:
        assert writer is not None, "a private slot's redirect names its writer"
        if not _won_redirect(repo, manifest, slot, writer, now):
            theirs = committed_at(repo, run, slot)
            if isinstance(theirs, Manifest) and same_content(theirs, manifest):
                return _found(repo, theirs)
            raise _conflict(manifest, theirs)
    body = manifest.to_bytes()
    own = Slot(slot.name, slot.slot, slot.slot, slot.trajectory)
    for attempt in range(_TAKE_BACK_TRIES):
        try:
            repo.put_manifest_if_absent(manifest, body, checksum.crc32c(body))
            break
        except PreconditionFailedError:
            # Ours from before a crash or a lost answer; at a canonical slot, another
            # writer's redirect won it; or a deleter withdrew the slot.
            theirs = committed_at(repo, run, own)
        if isinstance(theirs, Manifest) and same_content(theirs, manifest):
            return _found(repo, theirs)
        last = attempt == _TAKE_BACK_TRIES - 1
        if last or slot.private or not isinstance(theirs, Redirect):
            raise _conflict(manifest, theirs)
        if not take_back_name(repo, run, slot, theirs, writer, now):
            theirs = committed_at(repo, run, own)  # its manifest came: committed there
            if isinstance(theirs, Manifest) and same_content(theirs, manifest):
                return _found(repo, theirs)
            raise _conflict(manifest, theirs)
    crc = checksum.crc32c(body)
    return CommitResult(checksum.to_hex(crc), move_latest(repo, manifest, crc), False, manifest)


def move_latest(storage: Storage | Repository, manifest: Manifest, crc: int | None = None) -> bool:
    """Step 3 alone: point LATEST at ``manifest`` if ``moves_latest`` says so; whether it
    moved. ``crc`` is the stored manifest's CRC-32C (read back when None). Also for a
    checkpoint found committed already: a crash between steps 2 and 3 left LATEST
    behind it."""
    repo = storage if isinstance(storage, Repository) else Repository(storage)
    if crc is None:
        stored = repo.read_manifest_bytes(manifest.run_id, manifest.checkpoint)
        if stored is None:
            return False
        crc = checksum.crc32c(stored)
    if not moves_latest(repo.read_latest(manifest.run_id), manifest.step, manifest.lineage):
        return False
    lineage = manifest.lineage
    pointer = Latest(
        checkpoint=manifest.checkpoint,
        step=manifest.step,
        manifest_crc32c=checksum.to_hex(crc),
        trajectory=lineage.id or None,
        generation=lineage.generation or None,
    )
    repo.write_latest(manifest.run_id, pointer)
    return True
