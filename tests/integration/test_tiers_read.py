"""Reading several tiers at once (``ckptd.store.tiers``), against real directories laid
out by hand: ``list_across_tiers`` names who holds what and which tier's LATEST counts,
``verify_across_tiers`` checks each tier's own copy, and a tier that does not hold a
checkpoint is no mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptd.config import Settings
from ckptd.core import checksum
from ckptd.core.manifest import MANIFEST_NAME, build_manifest
from ckptd.storage.base import NotFoundError
from ckptd.store.tiers import TierStore, list_across_tiers, open_tiers, verify_across_tiers

RUN = "run"


def commit(root: Path, name: str, step: int, data: bytes, *, latest: bool) -> None:
    """A committed checkpoint as the store holds it: its object, its manifest, LATEST."""
    (root / RUN / name).mkdir(parents=True)
    (root / RUN / name / "weights.bin").write_bytes(data)
    manifest = build_manifest(
        run_id=RUN,
        checkpoint=name,
        step=step,
        layout="hf",
        host="node-1",
        created_at=step,
        committed_at=step,
        files=[("weights.bin", len(data), checksum.to_hex(checksum.crc32c(data)))],
        environment={},
    )
    (root / RUN / name / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    if latest:
        pointer = {"checkpoint": name, "step": step, "manifest_crc32c": "00000000"}
        (root / RUN / "LATEST").write_text(json.dumps(pointer))


@pytest.fixture()
def tiers(tmp_path: Path) -> list[TierStore]:
    """Two tiers: "primary" holds steps 1 and 2 (LATEST 2), "cold" only step 1 (its LATEST)."""
    primary, cold = tmp_path / "primary", tmp_path / "cold"
    commit(primary, "checkpoint-1", 1, b"one", latest=False)
    commit(primary, "checkpoint-2", 2, b"two", latest=True)
    commit(cold, "checkpoint-1", 1, b"one", latest=True)
    settings = Settings.model_validate(
        {
            "destination": {"url": primary.as_uri()},
            "tiers": [{"name": "cold", "url": cold.as_uri()}],
        }
    )
    return open_tiers(settings)


def test_the_listing_names_the_tiers_holding_each_checkpoint_oldest_first(
    tiers: list[TierStore],
) -> None:
    listing = list_across_tiers(tiers)
    assert listing.unreadable == {}
    rows = [(c.run, c.manifest.checkpoint, c.tiers, c.latest_in) for c in listing.checkpoints]
    assert rows == [
        (RUN, "checkpoint-1", ["primary", "cold"], ["cold"]),
        (RUN, "checkpoint-2", ["primary"], ["primary"]),
    ]


def test_latest_is_the_first_tiers_latest_whatever_the_others_say(
    tiers: list[TierStore],
) -> None:
    latest = {c.manifest.checkpoint: c.latest for c in list_across_tiers(tiers, RUN).checkpoints}
    assert latest == {"checkpoint-1": False, "checkpoint-2": True}


def test_a_tier_without_the_checkpoint_is_no_mismatch_and_a_bad_copy_is_one(
    tiers: list[TierStore], tmp_path: Path
) -> None:
    results = verify_across_tiers(tiers, RUN, "checkpoint-2")
    assert [(r.tier, r.held, r.problems) for r in results] == [
        ("primary", True, ()),
        ("cold", False, ()),
    ]
    (tmp_path / "cold" / RUN / "checkpoint-1" / "weights.bin").write_bytes(b"ONE")
    by_tier = {r.tier: r for r in verify_across_tiers(tiers, RUN, "checkpoint-1")}
    assert by_tier["primary"].problems == ()
    assert [p.path for p in by_tier["cold"].problems] == ["weights.bin"]


def test_verify_without_a_name_checks_each_tiers_own_newest(tiers: list[TierStore]) -> None:
    results = verify_across_tiers(tiers, RUN, None)
    assert [(r.tier, r.manifest and r.manifest.checkpoint) for r in results] == [
        ("primary", "checkpoint-2"),
        ("cold", "checkpoint-1"),
    ]


def test_a_checkpoint_no_tier_holds_is_not_found(tiers: list[TierStore]) -> None:
    with pytest.raises(NotFoundError, match="run/checkpoint-9 is not committed in any tier"):
        verify_across_tiers(tiers, RUN, "checkpoint-9")
    with pytest.raises(NotFoundError, match="is not committed"):
        verify_across_tiers(tiers[:1], RUN, "checkpoint-9")  # one tier: its own error
