"""Retention's cost after a commit does not grow with the run's history: counted request
by request by the fault proxy in front of SeaweedFS, which keeps listing a checkpoint's
prefix after its last object is deleted (the store where the cost grew fastest)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs

import pytest

from ckptd.commit.single import commit
from ckptd.core import checksum
from ckptd.core.manifest import build_manifest
from ckptd.repository import MANIFEST_NAME, Repository, manifest_key
from ckptd.storage import RetryingStorage, open_storage
from ckptd.store.catalog import FULL_REFRESH_SECONDS, RunCatalog
from ckptd.store.retention import apply_retention
from tests.integration.test_restore import commit_files
from tests.support.faultproxy import FaultProxy, RequestRecord

RUN = "run"
KEEP_LAST = 3
HISTORY = 300  # committed before the pass measured
ORPHAN_EVERY = 30  # a manifest-less leftover beside every 30th checkpoint


def _name(step: int) -> str:
    return f"checkpoint-{step}"


def _is_list(r: RequestRecord) -> bool:
    return r.method == "GET" and "list-type" in parse_qs(r.query)


def _manifest_gets(records: list[RequestRecord]) -> set[str]:
    """Manifests read (a GET that found none, of an upload in flight, read nothing)."""
    return {
        r.path
        for r in records
        if r.method == "GET" and r.status == 200 and r.path.endswith("/" + MANIFEST_NAME)
    }


def _seed(storage: RetryingStorage) -> None:
    """``HISTORY`` committed checkpoints (steps 10, 20, ...) and leftover uploads beside
    some of them, the way a long run leaves the store before retention ever ran."""
    for i in range(1, HISTORY + 1):
        commit_files(storage, RUN, _name(10 * i), {"w": b"w"}, step=10 * i)
        if i % ORPHAN_EVERY == 0:
            storage.put_bytes(f"{RUN}/{_name(10 * i + 5)}/w", b"w", crc32c=checksum.crc32c(b"w"))


@pytest.fixture
def storage(s3_dest: str, fault_proxy: FaultProxy) -> RetryingStorage:
    return open_storage(s3_dest, endpoint_url=fault_proxy.url)


def test_a_pass_after_300_commits_reads_no_manifest_twice_and_lists_a_constant_number(
    storage: RetryingStorage, fault_proxy: FaultProxy
) -> None:
    _seed(storage)
    catalog = RunCatalog()
    # The first pass reads every manifest once and deletes down to KEEP_LAST.
    fault_proxy.reset_counters()
    deleted = apply_retention(
        storage, RUN, keep_last=KEEP_LAST, keep_every_steps=0, catalog=catalog
    )
    # Every orphan goes but the newest, beside the newest checkpoint (an upload in flight).
    assert len(deleted) == HISTORY - KEEP_LAST + HISTORY // ORPHAN_EVERY - 1
    read_before = _manifest_gets(fault_proxy.requests)
    assert len(read_before) >= HISTORY
    # SeaweedFS still lists every emptied prefix: the case that made each pass cost
    # requests in proportion to the run's history.
    assert len(Repository(storage).list_names(RUN)) >= HISTORY

    for i in range(HISTORY + 1, HISTORY + 4):
        commit_files(storage, RUN, _name(10 * i), {"w": b"w"}, step=10 * i)
        fault_proxy.reset_counters()
        deleted = apply_retention(
            storage, RUN, keep_last=KEEP_LAST, keep_every_steps=0, catalog=catalog
        )
        records = fault_proxy.requests
        # The oldest kept, and the leftover beside checkpoint-3000 once it falls below.
        assert deleted[0] == _name(10 * (i - KEEP_LAST))
        assert set(deleted[1:]) <= {_name(10 * HISTORY + 5)}
        got = _manifest_gets(records)
        new_manifest = f"/{manifest_key(RUN, _name(10 * i))}"
        # Only the manifest just committed is read: nothing read before is read again.
        assert not (got & read_before), sorted(got & read_before)
        assert {p for p in got if p.endswith(new_manifest)} == got
        read_before |= got
        # Lists: the leases, the run's names (one page), the victim's objects.
        lists = [r for r in records if _is_list(r)]
        assert len(lists) <= 4, [r.query for r in lists]
        # Everything else is constant too: LATEST, one HEAD per kept manifest, deletes.
        assert len(records) <= 12 + KEEP_LAST, [(r.method, r.path, r.query) for r in records]

    kept = [c.manifest.checkpoint for c in Repository(storage).list_committed(RUN)]
    assert kept == [_name(10 * i) for i in range(HISTORY + 4 - KEEP_LAST, HISTORY + 4)]


def test_a_manifest_deleted_behind_the_catalog_is_not_counted_among_the_newest(
    storage: RetryingStorage,
) -> None:
    catalog = RunCatalog()
    for step in (1, 2, 3):
        commit_files(storage, RUN, _name(step), {"w": b"w"}, step=step)
    assert apply_retention(storage, RUN, keep_last=2, keep_every_steps=0, catalog=catalog) == [
        _name(1)
    ]
    # Someone deletes checkpoint-3's manifest by hand; then checkpoint-4 commits. Counted
    # from a stale catalog, 3 and 4 would be the newest two and checkpoint-2 deleted.
    storage.delete([manifest_key(RUN, _name(3))])
    commit_files(storage, RUN, _name(4), {"w": b"w"}, step=4)
    assert apply_retention(storage, RUN, keep_last=2, keep_every_steps=0, catalog=catalog) == []
    kept = [c.manifest.checkpoint for c in Repository(storage).list_committed(RUN)]
    assert kept == [_name(2), _name(4)]


def _commit_marker(storage: RetryingStorage, step: int, host: str = "test") -> None:
    at = 1_000_000.0 + step
    manifest = build_manifest(
        run_id=RUN,
        checkpoint=_name(step),
        step=step,
        layout="marker",
        host=host,
        created_at=at,
        committed_at=at,
        files=[],
        environment={},
    )
    commit(storage, manifest)


def test_the_catalog_reads_each_manifest_once_and_again_when_replaced_or_a_day_old(
    tmp_path: Path,
) -> None:
    storage = open_storage((tmp_path / "store").as_uri())
    repo = Repository(storage)
    catalog = RunCatalog()
    for step in (1, 2, 3):
        _commit_marker(storage, step)
    (tmp_path / "store" / RUN / "leftover").mkdir()  # a listed name with nothing in it
    catalog.refresh(repo, RUN, now=0.0, window=2)
    assert catalog.manifest_reads == 4 and sorted(catalog.committed) == [
        _name(s) for s in (1, 2, 3)
    ]
    catalog.refresh(repo, RUN, now=1.0, window=2)
    assert catalog.manifest_reads == 5  # only the name without a manifest is looked at again
    catalog.settle("leftover")
    _commit_marker(storage, 4)
    catalog.refresh(repo, RUN, now=2.0, window=2)
    assert catalog.manifest_reads == 6  # checkpoint-4, once; "leftover" no more
    # checkpoint-4 replaced behind ckptd's back (deleted, committed again by another host):
    # within the window, its HEAD differs, and it is read again.
    storage.delete([manifest_key(RUN, _name(4))])
    _commit_marker(storage, 4, host="another-host")
    catalog.refresh(repo, RUN, now=3.0, window=2)
    assert catalog.manifest_reads == 7
    assert catalog.committed[_name(4)].manifest.host == "another-host"
    # A name forgotten (this daemon just committed it) is read again, even if settled.
    catalog.settle(_name(1))
    catalog.forget(_name(1))
    catalog.refresh(repo, RUN, now=4.0, window=2)
    assert catalog.manifest_reads == 8 and _name(1) in catalog.committed
    # A day later everything is read again.
    catalog.refresh(repo, RUN, now=4.0 + FULL_REFRESH_SECONDS, window=2)
    assert catalog.manifest_reads == 13
