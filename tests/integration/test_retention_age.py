"""Retention by age (``keep_within``) beside count, per tier, and a pass killed at every
instant of its deletes: the pure rule, then the executor against a real directory and
SeaweedFS, with manifests whose commit times lie days in the past (no sleeping)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.config import TierRetentionConfig, parse_duration
from ckptd.core.manifest import MANIFEST_NAME
from ckptd.devtools.locals3 import LocalS3
from ckptd.repository import Repository, is_withdrawal
from ckptd.storage import RetryingStorage, open_storage
from ckptd.store.retention import Entry, apply_retention, plan_retention
from ckptd.store.verify import verify_checkpoint
from tests.integration.test_restore import commit_files

DAY = 86400.0
T0 = 1_780_000_000.0  # a fixed "now" for the pure cases


def _entries(*steps: int) -> list[Entry]:
    return [(f"ck-{s}", s) for s in steps]


# -- the rule ------------------------------------------------------------------------------


def test_duration_forms() -> None:
    assert parse_duration("7d") == 7 * DAY
    assert parse_duration("12h") == 12 * 3600
    assert parse_duration("30m") == 1800
    assert parse_duration("2w") == 14 * DAY
    assert parse_duration("90") == 90
    assert parse_duration("0") == 0
    assert TierRetentionConfig(keep_within="1.5d").keep_within_seconds == 1.5 * DAY
    for bad in ("", "7 days", "-1d", "d", "7y"):
        with pytest.raises(ValueError, match="is not a duration"):
            parse_duration(bad)


@pytest.mark.parametrize(
    ("ages_days", "keep_last", "keep_every", "within_days", "expected"),
    [
        # Age only (keep_last 0): everything older than 3 days goes, the newest never.
        ((10, 9, 5, 2, 1), 0, 0, 3, ["ck-1", "ck-2", "ck-3"]),
        ((10, 9, 8), 0, 0, 3, ["ck-1", "ck-2"]),  # all old: the newest stays
        # Count and age: the union (restic --keep-within), not the intersection.
        ((10, 9, 5, 2, 1), 1, 0, 3, ["ck-1", "ck-2", "ck-3"]),
        ((10, 9, 5, 2, 1), 4, 0, 3, ["ck-1"]),
        ((10, 9, 5, 2, 1), 2, 0, 6, ["ck-1", "ck-2"]),
        # ... and keep_every_steps on top: step 2 is a multiple of 2, step 4 too.
        ((10, 9, 5, 2, 1), 1, 2, 1.5, ["ck-1", "ck-3"]),
        # Neither count nor age rule: all kept, as keep_last = 0 always did.
        ((10, 9, 5), 0, 3, 0, []),
    ],
)
def test_keep_within_is_a_union_with_the_other_rules(
    ages_days: tuple[float, ...],
    keep_last: int,
    keep_every: int,
    within_days: float,
    expected: list[str],
) -> None:
    entries = _entries(*range(1, len(ages_days) + 1))
    times = {name: T0 - age * DAY for (name, _), age in zip(entries, ages_days, strict=True)}
    got = plan_retention(
        entries,
        keep_last=keep_last,
        keep_every_steps=keep_every,
        keep_within=within_days * DAY,
        committed_at=times,
        now=T0,
    )
    assert got == expected


def test_keep_within_agrees_with_a_reference_on_random_runs() -> None:
    seed = 16
    rng = random.Random(seed)
    print(f"seed {seed}")
    for _ in range(300):
        n = rng.randint(0, 12)
        entries = _entries(*sorted(rng.sample(range(1, 200), n)))
        times = {name: T0 - rng.uniform(0, 20) * DAY for name, _ in entries}
        if rng.random() < 0.1 and entries:
            times.pop(entries[0][0])  # a commit time that does not parse: kept
        keep_last, every = rng.randint(0, 4), rng.choice([0, 0, 5, 10])
        within = rng.choice([0.0, 1 * DAY, 7 * DAY])
        protected = {name for name, _ in entries if rng.random() < 0.1}
        got = plan_retention(
            entries,
            keep_last=keep_last,
            keep_every_steps=every,
            keep_within=within,
            committed_at=times,
            now=T0,
            protected=protected,
        )
        if keep_last == 0 and within == 0:
            assert got == []
            continue
        kept = set(protected) | {entries[-1][0]} if entries else set(protected)
        kept |= {name for name, _ in entries[-keep_last:]} if keep_last else set()
        kept |= {name for name, s in entries if every and s % every == 0}
        if within:
            kept |= {name for name, _ in entries if name not in times}
            kept |= {name for name, _ in entries if T0 - times.get(name, T0) <= within}
        assert got == [name for name, _ in entries if name not in kept], (entries, times)


# -- the executor, per tier, on real stores -------------------------------------------------


def commit_aged(storage: RetryingStorage, run: str, step: int, committed_at: float) -> None:
    """One committed checkpoint (three objects and its manifest) committed at a given time."""
    files = {"model.bin": os.urandom(96), "sub/optim.bin": os.urandom(48), "meta.json": b"{}"}
    commit_files(storage, run, f"checkpoint-{step}", files, step=step, committed_at=committed_at)


NOW = time.time()
# Steps 100..800, committed one a day, the newest an hour ago.
AGES = {100 * (i + 1): NOW - 3600 - (7 - i) * DAY for i in range(8)}


def _fill(storage: RetryingStorage) -> None:
    for step, when in AGES.items():
        commit_aged(storage, "run", step, when)


def _committed(storage: RetryingStorage) -> list[str]:
    return [c.manifest.checkpoint for c in Repository(storage).list_committed("run")]


def _prefixes(storage: RetryingStorage) -> set[str]:
    """Checkpoint prefixes holding any object but a withdrawal (what retention leaves of
    an orphan it collected, for an hour: ``ckptd.commit.withdrawal``)."""
    return {
        info.key.split("/")[1]
        for info in storage.list_objects("run/")
        if info.key.count("/") >= 2
        and not info.key.split("/")[1].startswith(".")
        and not (
            info.key.endswith("/" + MANIFEST_NAME) and is_withdrawal(storage.get_bytes(info.key))
        )
    }


@pytest.fixture
def two_tiers(
    local_s3: LocalS3, s3_dest: str, tmp_path: Path
) -> Iterator[dict[str, RetryingStorage]]:
    yield {
        "nfs": open_storage(f"file://{tmp_path / 'nfs'}"),
        "s3": open_storage(s3_dest, endpoint_url=local_s3.endpoint_url, max_attempts=2),
    }


def test_each_tier_keeps_by_its_own_age_and_count(two_tiers: dict[str, RetryingStorage]) -> None:
    # The fast tier keeps the newest 2 and two days; the object store a week and every
    # 400th step. Same checkpoints, two policies, two outcomes.
    policies: dict[str, dict[str, Any]] = {
        "nfs": {"keep_last": 2, "keep_every_steps": 0, "keep_within": parse_duration("2d")},
        "s3": {"keep_last": 0, "keep_every_steps": 400, "keep_within": parse_duration("5d")},
    }
    # Ages in days (+ 1 h): 800: 0, 700: 1, 600: 2, 500: 3, 400: 4, 300: 5 ...
    expected = {
        "nfs": ["checkpoint-700", "checkpoint-800"],  # 600 is past 2 d by the hour
        "s3": [f"checkpoint-{s}" for s in (400, 500, 600, 700, 800)],  # 300: past 5 d
    }
    for tier, storage in two_tiers.items():
        _fill(storage)
        apply_retention(storage, "run", now=NOW, **policies[tier])
        assert _committed(storage) == expected[tier], tier
        assert _prefixes(storage) == set(expected[tier]), tier  # nothing half-deleted left
    # A later pass, a month on, ages more out of the object store; the newest stays.
    s3 = two_tiers["s3"]
    apply_retention(s3, "run", now=NOW + 30 * DAY, **policies["s3"])
    assert _committed(s3) == ["checkpoint-400", "checkpoint-800"]


class _Killed(Exception):
    pass


class _DiesAfter:
    """A store that dies (raises) after ``n`` more objects were deleted: a kill -9 of the
    retention pass at that instant, mid-batch included."""

    def __init__(self, inner: RetryingStorage, n: int) -> None:
        self._inner = inner
        self.left = n

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            if self.left == 0:
                raise _Killed(key)
            self._inner.delete([key])
            self.left -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _check_no_half_deleted_checkpoint(storage: RetryingStorage, instant: int) -> None:
    """Whatever a reader sees as committed is whole and verifies; the newest is there."""
    repo = Repository(storage)
    committed = repo.list_committed("run")
    assert committed[-1].manifest.checkpoint == "checkpoint-800", instant
    for c in committed:
        assert verify_checkpoint(storage, c.manifest, concurrency=2) == [], (
            instant,
            c.manifest.checkpoint,
        )
    assert repo.resolve("run", None).checkpoint == "checkpoint-800"


POLICY: dict[str, Any] = {"keep_last": 2, "keep_every_steps": 0, "keep_within": 3 * DAY}
KEPT = ["checkpoint-600", "checkpoint-700", "checkpoint-800"]  # 2 newest, and 3 days


@pytest.mark.parametrize("tier", ["nfs", "s3"])
def test_retention_killed_at_any_instant_leaves_no_half_deleted_committed_checkpoint(
    two_tiers: dict[str, RetryingStorage], tier: str
) -> None:
    storage = two_tiers[tier]
    _fill(storage)
    # 5 victims x 4 keys (manifest first, then 3 objects): instants 0..19 are mid-pass.
    instants = list(range(20))
    if tier == "s3":  # each instant refills the bucket: a seeded sample there
        seed = 1616
        print(f"seed {seed}")
        instants = sorted(random.Random(seed).sample(instants, 6))
    for n, instant in enumerate(instants):
        if n:
            for info in storage.list_objects("run/"):
                storage.delete([info.key])
            _fill(storage)
        with pytest.raises(_Killed):
            apply_retention(_DiesAfter(storage, instant), "run", now=NOW, **POLICY)  # type: ignore[arg-type]
        _check_no_half_deleted_checkpoint(storage, instant)
        # The next pass (the daemon's next commit) finishes the job, orphans included.
        apply_retention(storage, "run", now=NOW, **POLICY)
        assert _committed(storage) == KEPT, instant
        assert _prefixes(storage) == set(KEPT), instant
