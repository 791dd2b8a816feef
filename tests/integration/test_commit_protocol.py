"""The commit protocol's steps against every store (``ckptd.commit.single``, docs/design.md
"Slots, claims and trajectories"), in process: each writer ships into a slot of its own,
exactly one content of a name commits per trajectory, and the bytes a committed manifest
names are the winner's, read back from the store and compared with what each writer wrote.

The same guarantees with whole daemons racing are ``tests/process/test_commit_races.py``."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from ckptd.commit.single import (
    CommitConflictError,
    Slot,
    Writer,
    commit,
    prepare_slot,
)
from ckptd.core import checksum
from ckptd.core.manifest import Manifest, build_manifest
from ckptd.repository import Repository, claim_key, object_key
from ckptd.storage import open_backend
from ckptd.store.retention import delete_checkpoint
from ckptd.store.verify import verify_checkpoint

RUN = "run"
NAME = "checkpoint-60"


@pytest.fixture(params=["seaweedfs", "gcs", "azure", "file"])
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> Repository:
    prefix = f"protocol-{uuid.uuid4().hex[:8]}"
    if request.param == "seaweedfs":
        endpoint = request.getfixturevalue("local_s3").endpoint_url
        return Repository(open_backend(f"s3://ckpt/{prefix}", endpoint_url=endpoint))
    if request.param == "gcs":
        endpoint = request.getfixturevalue("fake_gcs").endpoint_url
        return Repository(open_backend(f"gs://ckpt/{prefix}", endpoint_url=endpoint))
    if request.param == "azure":
        endpoint = request.getfixturevalue("azurite").endpoint_url
        return Repository(open_backend(f"az://ckpt/{prefix}", endpoint_url=endpoint))
    return Repository(open_backend(f"file://{tmp_path / 'store'}"))


def ship(repo: Repository, slot: Slot, files: dict[str, bytes], host: str = "test") -> Manifest:
    """What a writer does in steps 0-1: its files into its slot; the manifest to commit."""
    for path, data in files.items():
        repo.storage.put_bytes(object_key(RUN, slot.slot, path), data, crc32c=checksum.crc32c(data))
    return build_manifest(
        run_id=RUN,
        checkpoint=slot.slot,
        step=60,
        layout="hf",
        host=host,
        created_at=0,
        committed_at=0,
        files=[(p, len(d), checksum.to_hex(checksum.crc32c(d))) for p, d in files.items()],
        environment={},
        name=slot.name,
    )


def committed_bytes(repo: Repository, name: str) -> dict[str, bytes]:
    """The committed content of ``name`` as the store holds it, read object by object."""
    manifest = repo.resolve(RUN, name)
    return {
        f.path: repo.storage.get_bytes(object_key(RUN, manifest.checkpoint, f.path))
        for f in manifest.files
    }


def files_of(tag: bytes) -> dict[str, bytes]:
    return {"model.bin": tag * 1000 + os.urandom(8), "config.json": b"{" + tag + b"}"}


def test_two_writers_never_share_a_slot_and_one_content_commits(repo: Repository) -> None:
    a, b = Writer("aaaa", "node-a"), Writer("bbbb", "node-b")
    first = prepare_slot(repo, RUN, NAME, "", a, 0.0)
    second = prepare_slot(repo, RUN, NAME, "", b, 0.0)
    assert first.slot is not None and second.slot is not None
    assert first.slot.slot == NAME and not first.slot.private  # the home: the plain layout
    assert second.slot.private and second.slot.slot != NAME and second.slot.canonical == NAME
    ours, theirs = files_of(b"A"), files_of(b"B")
    manifest_b = ship(repo, second.slot, theirs, host="node-b")
    manifest_a = ship(repo, first.slot, ours, host="node-a")
    # The private slot's writer commits first (by redirect), so the owner loses.
    won = commit(repo, manifest_b, second.slot, b)
    assert not won.already_committed and won.manifest.checkpoint == second.slot.slot
    with pytest.raises(CommitConflictError) as lost:
        commit(repo, manifest_a, first.slot, a)
    assert lost.value.theirs["host"] == "node-b"
    assert committed_bytes(repo, NAME) == theirs  # byte for byte, one writer's
    assert verify_checkpoint(repo.storage, repo.resolve(RUN, NAME)) == []
    # The owner's objects are its own slot's: never under the winner's manifest.
    assert repo.storage.get_bytes(object_key(RUN, NAME, "model.bin")) == ours["model.bin"]


def test_the_owner_commits_first_and_the_private_writer_gets_the_conflict(
    repo: Repository,
) -> None:
    a, b = Writer("aaaa", "node-a"), Writer("bbbb", "node-b")
    first = prepare_slot(repo, RUN, NAME, "", a, 0.0)
    second = prepare_slot(repo, RUN, NAME, "", b, 0.0)
    assert first.slot is not None and second.slot is not None
    ours, theirs = files_of(b"A"), files_of(b"B")
    manifest_a, manifest_b = ship(repo, first.slot, ours), ship(repo, second.slot, theirs)
    commit(repo, manifest_a, first.slot, a)
    with pytest.raises(CommitConflictError):
        commit(repo, manifest_b, second.slot, b)
    assert committed_bytes(repo, NAME) == ours
    assert repo.read_manifest(RUN, second.slot.slot) is None  # the loser committed nothing
    # The same content from the private slot is committed already, not a conflict.
    same = ship(repo, second.slot, ours)
    assert commit(repo, same, second.slot, b).already_committed


def test_a_name_committed_already_is_found_before_anything_is_sent(repo: Repository) -> None:
    a, b = Writer("aaaa", "node-a"), Writer("bbbb", "node-b")
    first = prepare_slot(repo, RUN, NAME, "", a, 0.0)
    assert first.slot is not None
    commit(repo, ship(repo, first.slot, files_of(b"A")), first.slot, a)
    before = sorted((o.key, o.size) for o in repo.storage.list_objects(f"{RUN}/"))
    later = prepare_slot(repo, RUN, NAME, "", b, 1.0)
    assert later.slot is None and isinstance(later.committed, Manifest)
    assert later.committed.host == "test"
    # Nothing was written: no private claim, no object.
    assert sorted((o.key, o.size) for o in repo.storage.list_objects(f"{RUN}/")) == before


def test_a_restarted_writer_finds_its_own_slot_again(repo: Repository) -> None:
    a, b = Writer("aaaa", "node-a"), Writer("bbbb", "node-b")
    first = prepare_slot(repo, RUN, NAME, "", a, 0.0)
    again = prepare_slot(repo, RUN, NAME, "", a, 5.0)
    assert first.slot == again.slot
    private = prepare_slot(repo, RUN, NAME, "", b, 0.0)
    assert (
        private.slot is not None and private.slot == prepare_slot(repo, RUN, NAME, "", b, 9.0).slot
    )
    body = repo.storage.get_bytes(claim_key(RUN, NAME))
    assert b'"writer": "aaaa"' in body  # the claim stays the first writer's


def test_a_dead_owners_replacement_commits_and_the_zombie_never_can(repo: Repository) -> None:
    dead, fresh = Writer("dead", "node-a"), Writer("fresh", "node-b")
    owned = prepare_slot(repo, RUN, NAME, "", dead, 0.0)
    assert owned.slot is not None
    half = files_of(b"Z")
    repo.storage.put_bytes(  # half an upload, then the node died
        object_key(RUN, NAME, "model.bin"),
        half["model.bin"],
        crc32c=checksum.crc32c(half["model.bin"]),
    )
    replacement = prepare_slot(repo, RUN, NAME, "", fresh, 10.0)
    assert replacement.slot is not None and replacement.slot.private
    content = files_of(b"R")
    commit(repo, ship(repo, replacement.slot, content), replacement.slot, fresh)
    # The zombie wakes and finishes: its commit point is taken.
    with pytest.raises(CommitConflictError):
        commit(repo, ship(repo, owned.slot, half), owned.slot, dead)
    assert committed_bytes(repo, NAME) == content
    # The name's slot answers with a redirect: followed by restore and verify.
    assert repo.resolve(RUN, NAME).checkpoint == replacement.slot.slot
    # Deleting the content removes the redirect too, last: the name is free again.
    delete_checkpoint(repo, RUN, replacement.slot.slot, repo.resolve(RUN, NAME))
    assert repo.read_manifest_bytes(RUN, NAME) is None
    assert repo.read_manifest_bytes(RUN, replacement.slot.slot) is None


def test_another_trajectory_commits_the_same_name_beside_the_first(repo: Repository) -> None:
    a = Writer("aaaa", "node-a")
    old = prepare_slot(repo, RUN, NAME, "", a, 0.0)
    assert old.slot is not None
    old_content = files_of(b"O")
    commit(repo, ship(repo, old.slot, old_content), old.slot, a)
    fork = "qwertyui"
    new = prepare_slot(repo, RUN, NAME, fork, a, 1.0)  # the same node, after a rollback
    assert new.slot is not None and new.committed is None
    assert new.slot.slot == f"{NAME}~{fork}" and not new.slot.private
    new_content = files_of(b"N")
    commit(repo, ship(repo, new.slot, new_content), new.slot, a)
    assert committed_bytes(repo, NAME) == old_content  # the home: still the first line's
    assert committed_bytes(repo, f"{NAME}~{fork}") == new_content
