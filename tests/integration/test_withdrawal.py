"""Housekeeping beside a writer, on every store (``ckptd.commit.withdrawal``, I1 against deleters in
``ckptd.commit.slots``): ``rm``, ``rm --force`` and a retention pass run at many instants
of an upload (its claim, each file, just before its commit point, between the deleter's
plan and its deletes), each deleter also killed after each of its requests and run again.
After each: every committed manifest's objects are read back and compared with what the
writer wrote, byte for byte; a manifest over a hole or over foreign bytes fails the test.

The same with a whole daemon and the CLI is ``tests/process/test_housekeeping_beside_writer.py``.
"""

# ruff: noqa: F811  (``repo``: the four stores' fixture, imported, and each test's argument)
from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from ckptd.commit import single
from ckptd.commit.single import (
    CommitConflictError,
    Prepared,
    SlotWithdrawnError,
    Writer,
    commit,
    prepare_slot,
)
from ckptd.commit.slots import parse_withdrawal
from ckptd.commit.withdrawal import CLAIM_LIVE_SECONDS
from ckptd.core import checksum
from ckptd.core.manifest import Manifest, build_manifest
from ckptd.repository import Repository, manifest_key, object_key
from ckptd.storage.base import NotFoundError
from ckptd.store.removal import RemovalRefusedError, apply_removal, plan_removal
from ckptd.store.retention import apply_retention
from tests.integration.test_commit_protocol import repo  # noqa: F401  (the four stores)

RUN = "run"
NAME = "checkpoint-600"
FILES = ("model.safetensors", "optimizer.pt", "trainer_state.json")


class Killed(Exception):
    """The process making these requests was killed (``kill -9``) here."""


class Killable:
    """A store that dies after ``budget`` requests: what a deleter killed at that instant
    leaves behind (every request before it made, none after)."""

    def __init__(self, storage: Any, budget: int) -> None:
        self._storage = storage
        self._budget = budget
        self.made = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._storage, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.made >= self._budget:
                raise Killed(name)
            self.made += 1
            result = attr(*args, **kwargs)
            return list(result) if name.startswith("list") else result

        return call


class Upload:
    """One writer's checkpoint, shipped step by step as ``ckptd.sync.ship`` does: the
    claim (step 0), each file (step 1), then the commit (step 2)."""

    def __init__(self, repo: Repository, writer: Writer, *, claimed_at: float) -> None:
        self.repo = repo
        self.writer = writer
        self.files = {path: os.urandom(2048) + path.encode() for path in FILES}
        self.prepared: Prepared = prepare_slot(repo, RUN, NAME, "", writer, claimed_at)
        assert self.prepared.slot is not None
        self.sent = 0

    def send(self, count: int) -> None:
        """The next ``count`` files into the slot."""
        assert self.prepared.slot is not None
        for path in FILES[self.sent : self.sent + count]:
            data = self.files[path]
            key = object_key(RUN, self.prepared.slot.slot, path)
            self.repo.storage.put_bytes(key, data, crc32c=checksum.crc32c(data))
        self.sent = min(len(FILES), self.sent + count)

    def commit(self) -> Manifest | None:
        """Step 2: the manifest committed, or None when refused."""
        self.send(len(FILES))
        slot = self.prepared.slot
        assert slot is not None
        manifest = build_manifest(
            run_id=RUN,
            checkpoint=slot.slot,
            step=600,
            layout="hf",
            host=self.writer.host,
            created_at=0,
            committed_at=0,
            files=[(p, len(d), checksum.to_hex(checksum.crc32c(d))) for p, d in self.files.items()],
            environment={},
            name=NAME,
        )
        try:
            return commit(self.repo, manifest, slot, self.writer, now=time.time()).manifest
        except SlotWithdrawnError:
            return None


def assert_no_committed_hole(repo: Repository, writers: list[Upload]) -> list[str]:
    """Every committed content of ``NAME``: its objects, read back, are one writer's bytes
    exactly; returns the committed slots."""
    written = {w.files[p]: p for w in writers for p in FILES}
    committed = []
    for found in repo.list_committed(RUN):
        manifest = found.manifest
        if manifest.local_name != NAME:
            continue  # the run's other checkpoints, committed around the upload
        owners = set()
        for f in manifest.files:
            data = repo.storage.get_bytes(object_key(RUN, manifest.checkpoint, f.path))
            assert checksum.to_hex(checksum.crc32c(data)) == f.crc32c, (manifest.checkpoint, f)
            assert written.get(data) == f.path
            owners |= {i for i, w in enumerate(writers) if w.files[f.path] == data}
        assert len(owners) == 1, "a manifest over more than one writer's bytes"
        committed.append(manifest.checkpoint)
    return committed


def withdrawn(repo: Repository, slot: str) -> bool:
    body = repo.get_or_none(manifest_key(RUN, slot))
    return body is not None and parse_withdrawal(body) is not None


def remove(repo: Repository, *, force: bool) -> None:
    apply_removal(repo, plan_removal(repo, RUN, NAME, force=force))


def test_rm_beside_an_upload_refuses_then_withdraws_at_every_instant(
    repo: Repository,
) -> None:
    writer = Writer("writer-a", "node-a", node_rank=3)
    for sent in range(len(FILES) + 1):  # after the claim, after each file: up to the commit
        repo = Repository(repo.storage)
        upload = Upload(repo, writer, claimed_at=time.time())
        upload.send(sent)
        with pytest.raises(RemovalRefusedError) as refused:
            remove(repo, force=False)
        assert "node-a, node 3" in str(refused.value) and "claimed" in str(refused.value)
        assert upload.commit() is not None, "refused, rm deleted nothing: the writer commits"
        assert assert_no_committed_hole(repo, [upload]) == [NAME]
        # The same again, with --force: the writer is refused at its commit point.
        remove(repo, force=True)  # a committed LATEST: removed with --force
        upload = Upload(repo, writer, claimed_at=time.time())
        upload.send(sent)
        assert withdrawn(repo, NAME) is False
        remove(repo, force=True)
        assert withdrawn(repo, NAME)
        with pytest.raises(NotFoundError, match="is not committed \\(withdrawn by rm on "):
            repo.resolve(RUN, NAME)  # what restore --checkpoint and verify say of it
        assert upload.commit() is None
        assert assert_no_committed_hole(repo, [upload]) == []
        assert repo.read_latest(RUN) is None  # rm --force took LATEST with the commit
        # The next round starts from a clean name (a daemon's writer removes what it sent
        # after a conflict itself: ``ckptd.sync.outcomes``).
        repo.delete([i.key for i in repo.list_objects(RUN, NAME)])


def test_a_commit_between_rms_plan_and_its_deletes_is_kept_whole(
    repo: Repository,
) -> None:
    upload = Upload(repo, Writer("writer-a", "node-a"), claimed_at=time.time())
    upload.send(1)
    plan = plan_removal(repo, RUN, NAME, force=True)
    assert plan.uncommitted == [NAME] and NAME in plan.uploading
    assert upload.commit() is not None  # commits before rm deletes anything
    done = apply_removal(repo, plan)
    assert [s.kind for s in done.steps] == ["kept"]
    assert assert_no_committed_hole(repo, [upload]) == [NAME]


def test_rm_killed_after_each_request_never_lets_the_writer_commit_a_hole(
    repo: Repository,
) -> None:
    writer = Writer("writer-a", "node-a")
    budget = 0
    while True:
        name_repo = Repository(repo.storage)
        upload = Upload(name_repo, writer, claimed_at=time.time())
        upload.send(1)
        killable = Killable(repo.storage, budget)
        try:
            remove(Repository(killable), force=True)  # type: ignore[arg-type]
            finished = True
        except Killed:
            finished = False
        committed = upload.commit()
        slots = assert_no_committed_hole(name_repo, [upload])
        # Killed before its withdrawal stood, rm deleted nothing: the writer commits whole.
        # After it, the writer never commits, however far the deletes got.
        assert (committed is not None) == (not withdrawn(name_repo, NAME))
        assert slots == ([NAME] if committed is not None else [])
        if committed is None:
            remove(name_repo, force=True)  # run again: finishes the job
            assert [i.key for i in name_repo.list_objects(RUN, NAME)] == [manifest_key(RUN, NAME)]
        else:
            remove(name_repo, force=True)  # committed: LATEST, --force
        name_repo.delete([i.key for i in name_repo.list_objects(RUN, NAME)])
        if finished:
            break
        budget += 1
    assert budget >= 4  # the plan's reads, the withdrawal, the deletes: each instant tried


def _retain(repo: Repository, now: float) -> list[str]:
    return apply_retention(repo, RUN, keep_last=2, keep_every_steps=0, now=now)


def _commit_steps(repo: Repository, steps: tuple[int, ...]) -> None:
    for step in steps:
        name = f"checkpoint-{step}"
        data = os.urandom(256)
        repo.storage.put_bytes(object_key(RUN, name, "w"), data, crc32c=checksum.crc32c(data))
        manifest = build_manifest(
            run_id=RUN,
            checkpoint=name,
            step=step,
            layout="hf",
            host="h",
            created_at=0,
            committed_at=step,
            files=[("w", len(data), checksum.to_hex(checksum.crc32c(data)))],
            environment={},
        )
        commit(repo, manifest)


@pytest.mark.parametrize("claim_age", [0.0, CLAIM_LIVE_SECONDS + 60])
def test_retention_below_the_floor_keeps_a_live_upload_and_withdraws_a_stale_one(
    repo: Repository,
    claim_age: float,
) -> None:
    """checkpoint-600 uploads below the committed 700, 800, 900 (after a rollback, say):
    under the orphan floor. Live, retention keeps it at every instant; stale (its writer
    taken for gone), it is withdrawn and its writer refused, never committed over a hole."""
    _commit_steps(repo, (700, 800, 900))
    now = time.time()
    upload = Upload(repo, Writer("writer-a", "node-a"), claimed_at=now - claim_age)
    for _ in FILES:
        upload.send(1)
        _retain(repo, now)
    live = claim_age < CLAIM_LIVE_SECONDS
    assert (upload.commit() is not None) is live
    committed = assert_no_committed_hole(repo, [upload])
    assert (NAME in committed) is live
    assert withdrawn(repo, NAME) is not live


def test_retention_killed_after_each_request_never_lets_a_writer_commit_a_hole(
    repo: Repository,
) -> None:
    _commit_steps(repo, (700, 800, 900))
    now = time.time()
    budget = 0
    while True:
        upload = Upload(repo, Writer("writer-a", "node-a"), claimed_at=now - 2 * CLAIM_LIVE_SECONDS)
        upload.send(2)
        try:
            _retain(Repository(Killable(repo.storage, budget)), now)  # type: ignore[arg-type]
            finished = True
        except Killed:
            finished = False
        committed = upload.commit()
        assert (committed is not None) == (not withdrawn(repo, NAME))
        assert_no_committed_hole(repo, [upload])
        _retain(repo, now)  # the next pass finishes the job
        assert_no_committed_hole(repo, [upload])
        # Clean the name for the next instant (the withdrawal is an hour's otherwise).
        repo.delete([i.key for i in repo.list_objects(RUN, NAME)])
        if finished:
            break
        budget += 1
    assert budget >= 3


def _redirect_then_die(repo: Repository) -> tuple[Upload, Upload, Manifest]:
    """The home slot's writer and a private-slot writer of one name; the private one
    wins the redirect and dies before its manifest. Returns both and the private one's
    manifest, never written."""
    home = Upload(repo, Writer("writer-home", "node-a"), claimed_at=time.time())
    other = Upload(repo, Writer("writer-other", "node-b"), claimed_at=time.time())
    assert other.prepared.slot is not None and other.prepared.slot.private
    other.send(len(FILES))
    home.send(len(FILES))
    slot = other.prepared.slot
    manifest = build_manifest(
        run_id=RUN,
        checkpoint=slot.slot,
        step=600,
        layout="hf",
        host="node-b",
        created_at=0,
        committed_at=0,
        files=[(p, len(d), checksum.to_hex(checksum.crc32c(d))) for p, d in other.files.items()],
        environment={},
        name=NAME,
    )
    # Step 2a alone: the redirect, then killed before the manifest.
    assert single._won_redirect(repo, manifest, slot, other.writer, time.time())
    return home, other, manifest


def test_a_redirect_without_its_manifest_blocks_the_name_for_seconds_not_for_good(
    repo: Repository,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(single, "REDIRECT_GRACE_SECONDS", 0.5)
    home, other, manifest = _redirect_then_die(repo)
    started = time.monotonic()
    assert home.commit() is not None  # took the name back
    assert time.monotonic() - started >= 0.5
    assert repo.resolve(RUN, NAME).checkpoint == NAME
    assert assert_no_committed_hole(repo, [home, other]) == [NAME]
    # The late writer wakes: its slot is withdrawn and the name committed: it never
    # commits, whichever of the two its retry meets first.
    slot = other.prepared.slot
    assert slot is not None
    with pytest.raises(CommitConflictError):
        commit(repo, manifest, slot, other.writer, now=time.time())
    assert assert_no_committed_hole(repo, [home, other]) == [NAME]
    assert withdrawn(repo, slot.slot)


def test_a_redirect_whose_manifest_comes_within_the_grace_wins(
    repo: Repository,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(single, "REDIRECT_GRACE_SECONDS", 30.0)
    home, other, manifest = _redirect_then_die(repo)
    slot = other.prepared.slot
    assert slot is not None

    # The private writer was slow, not dead: its manifest comes a moment later.
    def write_late() -> None:
        time.sleep(0.3)
        body = manifest.to_bytes()
        repo.put_manifest_if_absent(manifest, body, checksum.crc32c(body))

    thread = threading.Thread(target=write_late)
    thread.start()
    started = time.monotonic()
    with pytest.raises(CommitConflictError) as lost:
        home.commit()
    thread.join()
    assert not isinstance(lost.value, SlotWithdrawnError)
    assert time.monotonic() - started < 20  # did not wait out the grace
    assert repo.resolve(RUN, NAME).checkpoint == slot.slot
    assert assert_no_committed_hole(repo, [home, other]) == [slot.slot]
