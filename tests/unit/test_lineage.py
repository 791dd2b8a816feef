"""Trajectories and slots, pure (``ckptd.commit.lineage``, ``ckptd.commit.slots``): which line
a trainer's saves continue, where LATEST goes, which checkpoints are abandoned, and which
slot commits a name."""

from __future__ import annotations

import pytest

from ckptd.commit.lineage import Resumed, abandoned, content_id, decide, fork_id, moves_latest
from ckptd.commit.slots import (
    Claim,
    canonical_for,
    letters,
    parse_claim,
    parse_redirect,
    private_slot,
    trajectory_slot,
)
from ckptd.core.manifest import (
    ROOT_TRAJECTORY,
    SCRATCH,
    ForkPoint,
    Latest,
    Manifest,
    ManifestError,
    Trajectory,
    build_manifest,
    parse_manifest,
)
from ckptd.layouts.base import step_of


def manifest(
    slot: str, trajectory: Trajectory = ROOT_TRAJECTORY, crc: str = "00000000"
) -> Manifest:
    name = slot.split("~")[0]
    return build_manifest(
        run_id="run",
        checkpoint=slot,
        step=step_of(name),
        layout="hf",
        host="h",
        created_at=0,
        committed_at=0,
        files=[("model.bin", 4, crc)],
        environment={},
        name=name,
        trajectory=trajectory,
    )


def latest_of(m: Manifest) -> Latest:
    return Latest(
        checkpoint=m.checkpoint,
        step=m.step,
        manifest_crc32c="00000000",
        trajectory=m.lineage.id or None,
        generation=m.lineage.generation or None,
    )


def test_resuming_from_the_newest_continues_its_trajectory() -> None:
    sixty = manifest("checkpoint-60")
    assert decide(Resumed(sixty), latest_of(sixty), sixty) == ROOT_TRAJECTORY
    # No report at all: the live trajectory, as before trajectories existed.
    assert decide(None, latest_of(sixty), sixty) == ROOT_TRAJECTORY


def test_resuming_from_an_older_checkpoint_forks_one_generation_up() -> None:
    forty, sixty = manifest("checkpoint-40"), manifest("checkpoint-60")
    forked = decide(Resumed(forty), latest_of(sixty), sixty)
    assert forked.generation == 1 and forked.id and forked.id != ""
    assert forked.forked_from == ForkPoint(checkpoint="checkpoint-40", step=40, trajectory="")
    # Every node (and every tier) derives the same id from the same facts...
    assert decide(Resumed(forty), latest_of(sixty), sixty) == forked
    # ...and another fork point, or another LATEST, gives another.
    twenty = manifest("checkpoint-20")
    assert decide(Resumed(twenty), latest_of(sixty), sixty).id != forked.id
    other_sixty = manifest("checkpoint-60", crc="11111111")
    assert decide(Resumed(forty), latest_of(other_sixty), other_sixty).id != forked.id


def test_a_rollback_of_a_rollback_is_another_generation_and_its_saves_continue_it() -> None:
    sixty = manifest("checkpoint-60")
    first = decide(Resumed(manifest("checkpoint-40")), latest_of(sixty), sixty)
    new_fifty = manifest("checkpoint-50~" + first.id, first)
    # The trainer restarted from its own newest save: the same (forked) trajectory.
    assert decide(Resumed(new_fifty), latest_of(new_fifty), new_fifty) == first
    second = decide(Resumed(manifest("checkpoint-20")), latest_of(new_fifty), new_fifty)
    assert second.generation == 2 and second.id not in ("", first.id)


def test_from_scratch_under_a_run_with_checkpoints_is_a_new_trajectory() -> None:
    sixty = manifest("checkpoint-60")
    fresh = decide(SCRATCH, latest_of(sixty), sixty)
    assert fresh.from_scratch and fresh.generation == 1 and fresh.forked_from is None
    assert decide(SCRATCH, None, None) == ROOT_TRAJECTORY  # an empty run: the first


def test_latest_moves_forward_on_its_line_and_to_newer_generations_only() -> None:
    sixty = latest_of(manifest("checkpoint-60"))
    fork = Trajectory(id=fork_id("x"), generation=1)
    assert moves_latest(None, 1, ROOT_TRAJECTORY)
    assert moves_latest(sixty, 70, ROOT_TRAJECTORY)
    assert not moves_latest(sixty, 50, ROOT_TRAJECTORY)  # backwards on the live line
    assert moves_latest(sixty, 50, fork)  # a rollback's first commit: a newer generation
    on_fork = latest_of(manifest("checkpoint-50~" + fork.id, fork))
    assert not moves_latest(on_fork, 70, ROOT_TRAJECTORY)  # a zombie on the old line
    assert moves_latest(on_fork, 60, fork)
    sibling = Trajectory(id=fork_id("y"), generation=1)
    assert not moves_latest(on_fork, 90, sibling)  # a sibling of the same generation


def test_abandoned_is_what_lies_off_the_live_lineage() -> None:
    twenty, forty, fifty, sixty = (manifest(f"checkpoint-{s}") for s in (20, 40, 50, 60))
    fork = decide(Resumed(forty), latest_of(sixty), sixty)
    new_fifty = manifest("checkpoint-50~" + fork.id, fork)
    new_sixty = manifest("checkpoint-60~" + fork.id, fork)
    every = [twenty, forty, fifty, sixty, new_fifty, new_sixty]
    assert abandoned(every, new_sixty.checkpoint) == {"checkpoint-50", "checkpoint-60"}
    assert abandoned(every, sixty.checkpoint) == {new_fifty.checkpoint, new_sixty.checkpoint}
    assert abandoned(every, None) == set()  # nothing says which line is live
    # A from-scratch trajectory abandons everything before it.
    fresh = Trajectory(id=fork_id("s"), generation=2, from_scratch=True)
    ten = manifest("checkpoint-10", fresh)
    assert abandoned([*every, ten], ten.checkpoint) == {m.checkpoint for m in every}


def test_the_canonical_slot_is_the_home_unless_another_trajectory_holds_it() -> None:
    def claim(name: str, trajectory: str, writer: str = "w") -> Claim:
        return Claim(
            run_id="run",
            checkpoint=name,
            name=name,
            writer=writer,
            host="h",
            claimed_at="2026-12-05T00:00:00Z",
            trajectory=trajectory,
            canonical=name,
        )

    assert canonical_for("checkpoint-60", "", None, None) == "checkpoint-60"
    assert canonical_for("checkpoint-60", "", claim("checkpoint-60", "", "other"), None) == (
        "checkpoint-60"  # the same trajectory, another writer: still the commit point
    )
    fork = fork_id("f")
    held = claim("checkpoint-60", "")
    assert canonical_for("checkpoint-60", fork, held, None) == f"checkpoint-60~{fork}"
    assert canonical_for("checkpoint-60", "", claim("checkpoint-60", fork), None) == (
        "checkpoint-60~original"
    )
    # A home committed before claims existed: its manifest's trajectory decides.
    assert canonical_for("checkpoint-60", fork, None, "") == f"checkpoint-60~{fork}"
    assert canonical_for("checkpoint-60", "", None, "") == "checkpoint-60"
    assert trajectory_slot("a", "") == "a~original"
    assert private_slot("a", "bcdefghi") == "a~bcdefghi"


def test_slot_letters_carry_no_digit_so_a_slot_keeps_its_names_step() -> None:
    for value in (0, 1, 2**63 - 1, 123456789):
        tag = letters(value)
        assert len(tag) == 8 and tag.isalpha() and tag.islower()
        assert step_of(f"checkpoint-60~{tag}") == 60


def test_claims_and_redirects_parse_only_as_themselves() -> None:
    claim = Claim(
        run_id="run",
        checkpoint="c~abcdefgh",
        name="c",
        writer="w",
        host="h",
        claimed_at="t",
        trajectory="",
        canonical="c",
    )
    assert parse_claim(claim.to_bytes()) == claim
    with pytest.raises(ManifestError):
        parse_claim(b'{"format": "ckptd.claim/1"}')
    with pytest.raises(ManifestError):
        parse_claim(claim.to_bytes().replace(b"c~abcdefgh", b"../x"))
    assert parse_redirect(manifest("checkpoint-1").to_bytes()) is None
    assert parse_redirect(b"garbage") is None


def test_lineage_fields_round_trip_and_stay_absent_on_the_first_trajectory() -> None:
    plain = manifest("checkpoint-1")
    doc = plain.to_bytes()
    assert b"trajectory" not in doc and b'"name"' not in doc and b"parent" not in doc
    fork = Trajectory(
        id=fork_id("z"),
        generation=3,
        forked_from=ForkPoint(checkpoint="checkpoint-1", step=1, trajectory=""),
    )
    forked = manifest("checkpoint-2~" + fork.id, fork)
    again = parse_manifest(forked.to_bytes())
    assert again == forked and again.local_name == "checkpoint-2" and again.lineage == fork
    assert content_id(plain) == content_id(manifest("checkpoint-9"))  # same files, same id
