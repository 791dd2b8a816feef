"""The pure many-node rules (``ckptd.commit.parts``): merge, conflicts, saves, who announces."""

from __future__ import annotations

import json

import pytest

from ckptd.commit import parts as cluster
from ckptd.commit.assemble import ClusterShip, Committer
from ckptd.commit.parts import (
    Announcement,
    Conflict,
    Merged,
    Part,
    Waiting,
    announcer_may_overwrite,
    files_fit_save,
    is_announcer,
    merge_parts,
    parse_announcement,
    parse_part,
    save_id,
    save_tail_seconds,
    superseded,
)
from ckptd.config import WatchConfig
from ckptd.core import names
from ckptd.core.manifest import ManifestError, ManifestFile, build_manifest, parse_manifest
from ckptd.core.names import rank_of_part
from ckptd.layouts.base import CheckpointListing, Completion, FileEntry
from ckptd.sync.coordination import judge_role
from ckptd.sync.runs import RunState


def ann(save: str = "aaaa0000", rank: int = 0, record_ns: int = 0) -> Announcement:
    return Announcement(
        run_id="run",
        checkpoint="step-10",
        save=save,
        node_rank=rank,
        layout="dcp",
        step=10,
        announced_at="2026-12-03T12:00:00Z",
        record_mtime_ns=record_ns,
    )


def part(rank: int, files: list[tuple[str, int, str]], save: str = "aaaa0000") -> Part:
    return Part(
        run_id="run",
        checkpoint="step-10",
        node_rank=rank,
        nodes=2,
        save=save,
        layout="dcp",
        step=10,
        host=f"node-{rank}",
        created_at=f"2026-12-03T12:00:0{rank}Z",
        verified_at="2026-12-03T12:00:09Z",
        total_bytes=sum(s for _, s, _ in files),
        files=cluster.part_files(files),
    )


def test_merge_is_the_union_with_each_path_once() -> None:
    parts = {
        0: part(0, [("__0_0.distcp", 10, "00000001"), (".metadata", 3, "00000003")]),
        1: part(1, [("__1_0.distcp", 20, "00000002"), ("shared.json", 5, "00000005")]),
    }
    parts[0] = part(
        0, [*((f.path, f.size, f.crc32c) for f in parts[0].files), ("shared.json", 5, "00000005")]
    )
    verdict = merge_parts(ann(), parts, 2)
    assert isinstance(verdict, Merged)
    assert [f.path for f in verdict.files] == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "shared.json",
    ]
    assert verdict.created_at == "2026-12-03T12:00:00Z"  # the earliest part's


def test_merge_waits_for_missing_ranks() -> None:
    verdict = merge_parts(ann(), {0: part(0, [("a", 1, "00000001")])}, 3)
    assert verdict == Waiting(missing=(1, 2))


def test_part_of_another_save_is_never_merged() -> None:
    parts = {
        0: part(0, [("a", 1, "00000001")]),
        1: part(1, [("b", 1, "00000002")], save="bbbb1111"),
    }
    verdict = merge_parts(ann(), parts, 2)
    assert verdict == Waiting(missing=(1,), stale=(1,))


def test_part_under_another_ranks_name_counts_as_missing() -> None:
    parts = {0: part(0, [("a", 1, "00000001")]), 1: part(0, [("b", 1, "00000002")])}
    assert merge_parts(ann(), parts, 2) == Waiting(missing=(1,), stale=(1,))


@pytest.mark.parametrize("other", [(5, "00000009"), (6, "00000005")])
def test_same_path_different_content_is_a_conflict(other: tuple[int, str]) -> None:
    parts = {0: part(0, [("x.json", 5, "00000005")]), 1: part(1, [("x.json", *other)])}
    verdict = merge_parts(ann(), parts, 2)
    assert isinstance(verdict, Conflict)
    assert verdict.path == "x.json"
    assert "node 0" in verdict.describe() and "node 1" in verdict.describe()


def test_save_id_is_stable_and_changes_with_any_file() -> None:
    files = [("b", 2, 20), ("a", 1, 10)]
    assert save_id(files) == save_id(list(reversed(files)))
    assert len(save_id(files)) == 8
    assert save_id(files) != save_id([("b", 2, 21), ("a", 1, 10)])
    assert save_id(files) != save_id([("b", 3, 20), ("a", 1, 10)])


@pytest.mark.parametrize(
    ("layout", "complete", "rank", "expected"),
    [
        ("dcp", True, 1, True),
        ("dcp", False, 0, False),
        ("quiescent", True, 0, True),
        ("quiescent", True, 1, False),  # auto's safety net on a node's bare shards
        ("hf", True, 2, True),
    ],
)
def test_who_announces(layout: str, complete: bool, rank: int, expected: bool) -> None:
    assert is_announcer(layout, complete, rank) is expected


def test_lowest_rank_leads_and_resaves_overwrite() -> None:
    assert announcer_may_overwrite(None, 1, "s1")
    assert not announcer_may_overwrite(ann("s1", rank=0), 0, "s1")  # already there
    assert announcer_may_overwrite(ann("s0", rank=0), 0, "s1")  # own re-save
    assert announcer_may_overwrite(ann("s0", rank=2), 1, "s1")
    assert not announcer_may_overwrite(ann("s0", rank=0), 1, "s1")


def test_files_newer_than_the_save_belong_to_a_later_one() -> None:
    a = ann(record_ns=100 * 10**9)
    assert files_fit_save(90 * 10**9, a, 30)
    assert files_fit_save(129 * 10**9, a, 30)  # a short tail after the record
    assert not files_fit_save(131 * 10**9, a, 30)
    assert files_fit_save(10**15, ann(record_ns=0), 30)  # no record time: no opinion


@pytest.mark.parametrize(
    ("layout", "tail"), [("dcp", 2.0), ("megatron", 2.0), ("hf", 30.0), ("deepspeed", 30.0)]
)
def test_the_tail_is_the_clock_skew_where_the_record_follows_every_rank(
    layout: str, tail: float
) -> None:
    # DCP's .metadata and Megatron's tracker come after a gather/barrier of every rank, so
    # a follower's shard seconds newer than the record is a re-save's, never this save's.
    assert save_tail_seconds(layout) == tail
    a = ann(record_ns=100 * 10**9)
    assert files_fit_save(int((100 + tail - 0.1) * 1e9), a, save_tail_seconds(layout))
    assert not files_fit_save(int((100 + tail + 0.1) * 1e9), a, save_tail_seconds(layout))


def test_superseded_needs_a_newer_commit_and_the_grace() -> None:
    assert superseded(10, 20, since=0.0, now=100.0, grace_seconds=50)
    assert not superseded(10, 20, since=0.0, now=40.0, grace_seconds=50)
    assert not superseded(20, 20, since=0.0, now=100.0, grace_seconds=50)
    assert not superseded(None, 20, since=0.0, now=100.0, grace_seconds=50)
    assert not superseded(10, None, since=0.0, now=100.0, grace_seconds=50)


def test_part_names() -> None:
    assert names.part_name(3) == "ckptd.part-3.json"
    assert rank_of_part("ckptd.part-12.json") == 12
    for name in ("ckptd.part-.json", "ckptd.part-1.json.tmp", "x.json", "ckptd.manifest.json"):
        assert rank_of_part(name) is None
    assert names.is_cluster_object("ckptd.announce.json")


def test_round_trip_and_bad_bodies() -> None:
    a = ann("abcd0123", record_ns=5)
    assert parse_announcement(a.to_bytes()) == a
    p = part(1, [("a/b", 1, "00000001")])
    assert parse_part(p.to_bytes()) == p
    doc = json.loads(p.to_bytes())
    doc["files"][0]["path"] = "../escape"
    with pytest.raises(ManifestError, match="invalid part"):
        parse_part(json.dumps(doc).encode())
    with pytest.raises(ManifestError):
        parse_announcement(b'{"format": "ckptd.announce/9"}')


def test_single_node_manifest_has_no_cluster_fields() -> None:
    kwargs = dict(
        run_id="r",
        checkpoint="c-1",
        step=1,
        layout="hf",
        host="h",
        created_at=0.0,
        committed_at=0.0,
        files=[("a", 1, "00000001")],
        environment={},
    )
    one = json.loads(build_manifest(**kwargs).to_bytes())  # type: ignore[arg-type]
    assert "nodes" not in one and "save" not in one
    many = build_manifest(**kwargs, nodes=2, save="abcd0123")  # type: ignore[arg-type]
    doc = json.loads(many.to_bytes())
    assert doc["nodes"] == 2 and doc["save"] == "abcd0123"
    assert parse_manifest(many.to_bytes()) == many
    assert ManifestFile(path="a", size=1, crc32c="00000001") in many.files


# -- who ships what: judge_role (sync layer, no I/O) ------------------------------------


def _judge(
    rank: int,
    files: tuple[tuple[str, int, int], ...],
    known: Announcement | None,
    *,
    complete: bool,
    layout: str = "dcp",
    now: float = 1000.0,
) -> tuple[Completion, ClusterShip | None, RunState]:
    state = RunState.of(WatchConfig(dir="/tmp/run", run_id="run", settle_seconds=1.0))
    if known is not None:
        state.announcements["step-10"] = known
    listing = CheckpointListing(
        name="step-10",
        is_dir=True,
        files=tuple(FileEntry(p, s, m) for p, s, m in files),
        open_for_write=frozenset(),
    )
    verdict = Completion(complete=complete, layout=layout, reason="rule", files=listing.files)
    verdict, role = judge_role(state, listing, verdict, Committer(2, rank, "h"), now)
    return verdict, role, state


SHARDS = (("__2_0.distcp", 10, 900 * 10**9), ("__3_0.distcp", 11, 901 * 10**9))


def test_the_record_holder_announces_its_own_save() -> None:
    verdict, role, state = _judge(0, SHARDS, None, complete=True)
    assert verdict.complete and role is not None and role.announcement is not None
    assert role.save == role.announcement.save == save_id(SHARDS)
    assert role.announcement.record_mtime_ns == 901 * 10**9
    assert not state.awaiting


def test_a_node_without_the_record_waits_for_the_announcement() -> None:
    verdict, role, state = _judge(1, SHARDS, None, complete=False)
    assert not verdict.complete and role is None
    assert "announce" in verdict.reason and "step-10" in state.awaiting


def test_a_follower_ships_the_announced_save_once_quiet() -> None:
    known = ann("feed0001", rank=0, record_ns=905 * 10**9)
    verdict, role, _ = _judge(1, SHARDS, known, complete=False)
    assert verdict.complete and role is not None
    assert role.save == "feed0001" and role.announcement is None
    assert verdict.layout == "dcp"
    # Changed within the quiet window: not yet.
    verdict, role, _ = _judge(1, SHARDS, known, complete=False, now=901.5)
    assert not verdict.complete and role is None and verdict.recheck_after


def test_files_of_a_later_save_wait_for_its_announcement() -> None:
    known = ann("feed0001", rank=0, record_ns=800 * 10**9)  # 100 s before these files
    verdict, role, state = _judge(1, SHARDS, known, complete=False)
    assert not verdict.complete and role is None
    assert "later" in verdict.reason and "step-10" in state.awaiting


def test_a_second_record_holder_follows_the_lower_rank() -> None:
    known = ann("feed0001", rank=0, record_ns=905 * 10**9)
    _, role, _ = _judge(1, SHARDS, known, complete=True, layout="hf")
    assert role is not None and role.announcement is None and role.save == "feed0001"
    # ...but a higher rank's announcement does not lead this node.
    _, role, _ = _judge(1, SHARDS, ann("feed0002", rank=3), complete=True, layout="hf")
    assert role is not None and role.announcement is not None and role.save == save_id(SHARDS)


def test_a_node_never_follows_its_own_earlier_save() -> None:
    own_old = ann("feed0001", rank=1, record_ns=905 * 10**9)
    verdict, role, state = _judge(1, SHARDS, own_old, complete=False)
    assert not verdict.complete and role is None and "step-10" in state.awaiting


def test_a_suspect_part_makes_the_whole_checkpoint_suspect_and_older_parts_read_as_sound() -> None:
    sound = part(0, [("a", 1, "00000001")])
    nan = part(1, [("b", 2, "00000002")]).model_copy(
        update={"suspect": "a non-finite loss at step 9"}
    )
    verdict = merge_parts(ann(), {0: sound, 1: nan}, 2)
    assert isinstance(verdict, Merged)
    assert verdict.suspect == "node 1: a non-finite loss at step 9"
    # Written and read back as a node writes it; a sound part carries no field at all,
    # so an older committer reads it as before.
    assert parse_part(nan.to_bytes()).suspect == "a non-finite loss at step 9"
    assert "suspect" not in json.loads(sound.to_bytes())
    both_sound = merge_parts(ann(), {0: sound, 1: part(1, [("b", 2, "00000002")])}, 2)
    assert isinstance(both_sound, Merged) and both_sound.suspect is None
