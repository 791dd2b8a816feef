"""Retention: the pure policies (many cases), and the executors against SeaweedFS and a
real directory, including a pass killed half-way and rerun."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.core import checksum
from ckptd.core.manifest import MANIFEST_NAME, Latest
from ckptd.repository import (
    LEASE_DIR,
    Repository,
    is_withdrawal,
    latest_key,
    lease_checkpoint,
    lease_is_fresh,
    manifest_key,
)
from ckptd.storage import RetryingStorage
from ckptd.store.retention import (
    Entry,
    apply_local_cleanup,
    apply_retention,
    plan_local_cleanup,
    plan_orphans,
    plan_retention,
)
from tests.integration.test_restore import commit_files

# -- plan_retention -----------------------------------------------------------------------


def _steps(*steps: int | None) -> list[Entry]:
    return [(f"ck-{s}" if s is not None else f"named-{i}", s) for i, s in enumerate(steps)]


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_every", "protected", "expected"),
    [
        # keep_last 0 keeps everything, whatever else is asked.
        ((1, 2, 3), 0, 0, set(), []),
        ((1, 2, 3), 0, 2, set(), []),
        # Newest N by position.
        ((1, 2, 3, 4, 5), 2, 0, set(), ["ck-1", "ck-2", "ck-3"]),
        ((1, 2, 3), 3, 0, set(), []),
        ((1, 2, 3), 10, 0, set(), []),
        ((), 3, 0, set(), []),
        # Multiples of keep_every are kept too (step 0 is a multiple).
        ((0, 100, 200, 300, 400, 500), 1, 200, set(), ["ck-100", "ck-300"]),
        ((10, 20, 30, 40), 1, 1, set(), []),
        # Step-less checkpoints are never multiples.
        ((None, 100, None, 200), 1, 100, set(), ["named-0", "named-2"]),
        # Protected names survive.
        ((1, 2, 3, 4), 1, 0, {"ck-2"}, ["ck-1", "ck-3"]),
        ((1, 2, 3, 4), 1, 0, {"ck-1", "ck-2", "ck-3"}, []),
        ((1, 2, 3, 4), 1, 0, {"not-there"}, ["ck-1", "ck-2", "ck-3"]),
    ],
)
def test_plan_retention_cases(
    steps: tuple[int | None, ...],
    keep_last: int,
    keep_every: int,
    protected: set[str],
    expected: list[str],
) -> None:
    assert (
        plan_retention(
            _steps(*steps), keep_last=keep_last, keep_every_steps=keep_every, protected=protected
        )
        == expected
    )


def test_plan_retention_agrees_with_a_reference_on_random_runs() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        n = rng.randrange(0, 25)
        steps = sorted(rng.sample(range(0, 5000, 10), n))
        committed: list[Entry] = [(f"ck-{s}", None if rng.random() < 0.1 else s) for s in steps]
        keep_last = rng.randrange(0, 8)
        keep_every = rng.choice([0, 0, 50, 100, 250, 1000])
        protected = {name for name, _ in committed if rng.random() < 0.1}
        victims = plan_retention(
            committed, keep_last=keep_last, keep_every_steps=keep_every, protected=protected
        )
        # Reference: keep = newest keep_last | multiples | protected; all if keep_last == 0.
        keep: set[str] = set()
        for i, (name, step) in enumerate(committed):
            if keep_last == 0 or i >= len(committed) - keep_last:
                keep.add(name)
            if keep_every and step is not None and step % keep_every == 0:
                keep.add(name)
        keep |= protected
        assert victims == [name for name, _ in committed if name not in keep]
        assert set(victims).isdisjoint(protected)
        if committed and keep_last:
            assert committed[-1][0] not in victims  # the newest always survives


def test_plan_retention_rejects_negative_settings() -> None:
    with pytest.raises(ValueError):
        plan_retention([], keep_last=-1, keep_every_steps=0)


# -- plan_orphans -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("orphans", "committed", "keep_last", "protected", "expected"),
    [
        # Older than the oldest of the newest keep_last: leftovers of a cut-short deletion.
        ([("ck-1", 1), ("ck-2", 2)], [("ck-3", 3), ("ck-4", 4)], 2, set(), ["ck-1", "ck-2"]),
        # Newer than that: could be an upload in flight.
        ([("ck-5", 5)], [("ck-3", 3), ("ck-4", 4)], 2, set(), []),
        ([("ck-35", 35)], [("ck-30", 30), ("ck-40", 40)], 2, set(), []),
        # keep_every kept an old one; an orphan between it and the window is still garbage.
        ([("ck-15", 15)], [("ck-10", 10), ("ck-20", 20), ("ck-25", 25)], 2, set(), ["ck-15"]),
        # No step, protected, or nothing committed to compare with: kept.
        ([("tmp", None)], [("ck-3", 3)], 1, set(), []),
        ([("ck-1", 1)], [("ck-3", 3)], 1, {"ck-1"}, []),
        ([("ck-1", 1)], [], 1, set(), []),
        ([("ck-1", 1)], [("named", None)], 1, set(), []),
        # keep_last 0: compared with all committed.
        ([("ck-1", 1), ("ck-4", 4)], [("ck-3", 3), ("ck-5", 5)], 0, set(), ["ck-1"]),
    ],
)
def test_plan_orphans_cases(
    orphans: list[Entry],
    committed: list[Entry],
    keep_last: int,
    protected: set[str],
    expected: list[str],
) -> None:
    assert plan_orphans(orphans, committed, keep_last=keep_last, protected=protected) == expected


# -- plan_local_cleanup -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local", "committed", "keep", "expected"),
    [
        (["a-1", "a-2", "a-3"], {"a-1", "a-2", "a-3"}, 0, []),  # 0: never delete (opt-in)
        (["a-1", "a-2", "a-3"], {"a-1", "a-2", "a-3"}, 1, ["a-1", "a-2"]),
        (["a-1", "a-2", "a-3"], {"a-1", "a-2", "a-3"}, 2, ["a-1"]),
        (["a-1", "a-2", "a-3"], {"a-2"}, 1, ["a-2"]),  # a-1 not committed: kept
        (["a-1", "a-2", "a-3"], set(), 1, []),
        (["a-1"], {"a-1"}, 1, []),  # the newest local one, always
        ([], {"a-1"}, 1, []),
        (["a-1", "a-2", "a-3"], {"a-1", "a-2", "a-3"}, 5, []),
    ],
)
def test_plan_local_cleanup_cases(
    local: list[str], committed: set[str], keep: int, expected: list[str]
) -> None:
    entries = [(name, int(name.split("-")[1])) for name in local]
    assert plan_local_cleanup(entries, committed, local_keep_last=keep) == expected


# -- leases (pure parts) ------------------------------------------------------------------


def test_lease_freshness_and_name() -> None:
    body = json.dumps({"checkpoint": "ck-1", "taken_at": 1000.0}).encode()
    assert lease_is_fresh(body, now=1000.0 + 3599)
    assert not lease_is_fresh(body, now=1000.0 + 3601)
    assert lease_is_fresh(b"garbage", now=1e12)  # unsure: keep
    assert lease_checkpoint(body, "whatever") == "ck-1"
    assert lease_checkpoint(b"garbage", "step-5-" + "a" * 32) == "step-5"
    assert lease_checkpoint(b"garbage", "no-token") is None


def test_policy_module_imports_no_io_frameworks() -> None:
    code = (
        "import sys, ckptd.store.retention\n"
        "bad = [m for m in ('boto3', 'botocore', 'asyncio', 'aiohttp') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- apply_retention against real stores ---------------------------------------------------


STEPS = list(range(100, 2100, 100))  # 20 checkpoints


def _commit_run(storage: RetryingStorage) -> None:
    for step in STEPS:
        commit_files(
            storage,
            "run",
            f"checkpoint-{step}",
            {"model.bin": os.urandom(64), "sub/optim.bin": os.urandom(32), ".metadata": b"m"},
            step=step,
        )


def _state(storage: RetryingStorage) -> tuple[list[str], set[str]]:
    """(committed names oldest first, checkpoint prefixes holding any object but a
    withdrawal: what retention leaves of an orphan it collected, for an hour)."""
    committed = [c.manifest.checkpoint for c in Repository(storage).list_committed("run")]
    prefixes = {
        info.key.split("/")[1]
        for info in storage.list_objects("run/")
        if info.key.count("/") >= 2
        and not info.key.split("/")[1].startswith(".")
        and not _is_withdrawal(storage, info.key)
    }
    return committed, prefixes


def _is_withdrawal(storage: RetryingStorage, key: str) -> bool:
    return key.endswith("/" + MANIFEST_NAME) and is_withdrawal(storage.get_bytes(key))


def test_retention_keeps_exactly_the_policy_over_20_checkpoints(storage: RetryingStorage) -> None:
    _commit_run(storage)
    deleted = apply_retention(storage, "run", keep_last=3, keep_every_steps=500)
    kept = [f"checkpoint-{s}" for s in (500, 1000, 1500, 1800, 1900, 2000)]
    assert deleted == [f"checkpoint-{s}" for s in STEPS if f"checkpoint-{s}" not in kept]
    committed, prefixes = _state(storage)
    assert committed == kept
    assert prefixes == set(kept)  # not one object of a deleted checkpoint is left
    # Idempotent: a second pass finds nothing to do.
    assert apply_retention(storage, "run", keep_last=3, keep_every_steps=500) == []


def test_retention_killed_mid_deletion_is_finished_by_the_next_run(
    storage: RetryingStorage,
) -> None:
    _commit_run(storage)
    committed = [(f"checkpoint-{s}", s) for s in STEPS]
    victims = plan_retention(committed, keep_last=4, keep_every_steps=700)
    assert len(victims) == 14
    # As if killed: some victims lost only their manifest, one also half its objects,
    # and the pass died before touching the rest.
    storage.delete([manifest_key("run", name) for name in victims[:6]])
    storage.delete(["run/" + victims[2] + "/model.bin"])
    assert [c.manifest.checkpoint for c in Repository(storage).list_committed("run")] == [
        name for name, _ in committed if name not in victims[:6]
    ]
    deleted = apply_retention(storage, "run", keep_last=4, keep_every_steps=700)
    assert sorted(deleted) == sorted(victims)
    kept = [name for name, _ in committed if name not in victims]
    assert kept == [f"checkpoint-{s}" for s in (700, 1400, 1700, 1800, 1900, 2000)]
    assert _state(storage) == (kept, set(kept))


def test_retention_never_deletes_what_latest_names(storage: RetryingStorage) -> None:
    _commit_run(storage)
    # LATEST names an old checkpoint (a rollback by hand, say).
    pointer = Latest(checkpoint="checkpoint-300", step=300, manifest_crc32c="00000000").to_bytes()
    storage.put_bytes(latest_key("run"), pointer, crc32c=checksum.crc32c(pointer))
    apply_retention(storage, "run", keep_last=2, keep_every_steps=0)
    committed, prefixes = _state(storage)
    assert committed == ["checkpoint-300", "checkpoint-1900", "checkpoint-2000"]
    assert prefixes == set(committed)


def test_orphans_in_flight_protected_or_unreadable_are_left_alone(
    storage: RetryingStorage,
) -> None:
    for step in (10, 20, 30, 40):
        commit_files(storage, "run", f"ck-{step}", {"w": b"w"}, step=step)
    # Manifest-less prefixes: leftovers (5, 15), an upload in flight (50), one this node
    # is uploading (8), one without a step, and one whose manifest does not parse.
    for name in ("ck-5", "ck-15", "ck-50", "ck-8", "scratch", "ck-1"):
        storage.put_bytes(f"run/{name}/w", b"w", crc32c=checksum.crc32c(b"w"))
    junk = b'{"format": "ckptd.manifest/9"}'
    storage.put_bytes(manifest_key("run", "ck-1"), junk, crc32c=checksum.crc32c(junk))
    deleted = apply_retention(storage, "run", keep_last=2, keep_every_steps=0, protected={"ck-8"})
    assert deleted[:2] == ["ck-10", "ck-20"] and sorted(deleted[2:]) == ["ck-15", "ck-5"]
    committed, prefixes = _state(storage)
    assert committed == ["ck-30", "ck-40"]
    assert prefixes == {"ck-30", "ck-40", "ck-50", "ck-8", "scratch", "ck-1"}


def test_fresh_restore_lease_protects_and_stale_one_is_removed(storage: RetryingStorage) -> None:
    for step in (1, 2, 3, 4):
        commit_files(storage, "run", f"ck-{step}", {"w": b"w"}, step=step)
    now = 1_000_000.0
    Repository(storage).take_lease("run", "ck-1", now=now - 60)  # fresh
    stale = Repository(storage).take_lease("run", "ck-2", now=now - 7200)  # an hour+ old
    deleted = apply_retention(storage, "run", keep_last=1, keep_every_steps=0, now=now)
    assert deleted == ["ck-2", "ck-3"]
    assert [c.manifest.checkpoint for c in Repository(storage).list_committed("run")] == [
        "ck-1",
        "ck-4",
    ]
    leases = [i.key for i in storage.list_objects(f"run/{LEASE_DIR}/")]
    assert len(leases) == 1 and stale not in leases


# -- apply_local_cleanup (a real directory) -----------------------------------------------


def test_local_cleanup_deletes_only_committed_direct_children_never_through_symlinks(
    tmp_path: Path,
) -> None:
    watch = tmp_path / "watch"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"keep me")
    for step in (1, 2, 3, 4):
        d = watch / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "model.bin").write_bytes(b"x" * step)
    # A link inside a doomed checkpoint, and a child that is itself a link: neither is
    # followed.
    os.symlink(outside, watch / "checkpoint-1" / "link-out")
    os.symlink(outside, watch / "checkpoint-0")
    (watch / "epoch=0-step=5.ckpt").write_bytes(b"single")
    local = [
        ("checkpoint-0", 0),
        ("checkpoint-1", 1),
        ("checkpoint-2", 2),
        ("epoch=0-step=5.ckpt", 5),
        ("checkpoint-3", 3),
        ("checkpoint-4", 4),
        ("../outside", 6),
        ("checkpoint-9", 9),
    ]
    committed = {name for name, _ in local} - {"checkpoint-2"}
    deleted = apply_local_cleanup(watch, local, committed, local_keep_last=1)
    assert deleted == ["checkpoint-1", "epoch=0-step=5.ckpt", "checkpoint-3", "checkpoint-4"]
    assert sorted(os.listdir(watch)) == ["checkpoint-0", "checkpoint-2"]
    assert sorted(os.listdir(outside)) == ["precious.bin"]
    assert (outside / "precious.bin").read_bytes() == b"keep me"
