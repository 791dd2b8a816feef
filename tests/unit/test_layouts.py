"""Completion rules, pure: listings in, verdicts out, time passed as ``now_ns``."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

import ckptd.layouts
from ckptd.layouts import (
    AUTO_ORDER,
    LAYOUT_NAMES,
    RULES,
    CheckpointListing,
    Completion,
    FileEntry,
    RuleSettings,
    evaluate,
    is_checkpoint_candidate,
    step_of,
)

S = 1_000_000_000
NOW = 1_800_000_000 * S
SETTINGS = RuleSettings(quiescence_seconds=10.0, marker="COMPLETE", settle_seconds=2.0)
LONG_AGO = 3600.0  # seconds before NOW: quiet by any window


def listing(
    name: str,
    files: Mapping[str, float] | Sequence[str] = (),
    *,
    is_dir: bool = True,
    age: float = LONG_AGO,
    trackers: dict[str, str] | None = None,
    siblings: frozenset[str] = frozenset(),
    writers: frozenset[str] | None = frozenset(),
    size: int = 100,
) -> CheckpointListing:
    """A listing whose files are ``age`` seconds old unless a dict gives each file's age."""
    ages = dict(files) if isinstance(files, Mapping) else dict.fromkeys(files, age)
    return CheckpointListing(
        name=name,
        is_dir=is_dir,
        files=tuple(
            FileEntry(path=p, size=size, mtime_ns=NOW - int(a * S)) for p, a in ages.items()
        ),
        trackers=trackers or {},
        siblings=siblings,
        open_for_write=writers,
    )


def judge(layout: str, snap: CheckpointListing, now_ns: int = NOW) -> Completion:
    return evaluate(layout, snap, now_ns, SETTINGS)


def paths(verdict: Completion) -> list[str]:
    return [f.path for f in verdict.files]


HF_FILES = [
    "model.safetensors",
    "config.json",
    "training_args.bin",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
]


# --- step_of ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("checkpoint-500", 500),
        ("global_step10", 10),
        ("iter_0000500", 500),
        ("epoch=1-step=9.ckpt", 9),
        ("run2-step700", 700),
        ("1000", 1000),
        ("final", None),
        ("", None),
    ],
)
def test_step_of_is_the_last_run_of_digits(name: str, step: int | None) -> None:
    assert step_of(name) == step


# --- the registry and auto --------------------------------------------------------------


def test_every_concrete_layout_has_a_rule_under_its_own_name() -> None:
    assert set(RULES) == set(LAYOUT_NAMES) - {"auto"}
    assert all(rule.name == key for key, rule in RULES.items())
    assert set(AUTO_ORDER) == set(RULES) - {"quiescent"}


def test_unknown_layout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'zarr'"):
        judge("zarr", listing("x", ["a"]))


@pytest.mark.parametrize(
    ("snap", "expected"),
    [
        (listing("checkpoint-5", HF_FILES), "hf"),
        (listing("step-5", ["__0_0.distcp", ".metadata"]), "dcp"),
        (
            listing(
                "global_step5", ["mp_rank_00_model_states.pt"], trackers={"latest": "global_step5"}
            ),
            "deepspeed",
        ),
        (
            listing(
                "iter_0000005",
                ["mp_rank_00/model_optim_rng.pt"],
                trackers={"latest_checkpointed_iteration.txt": "5"},
            ),
            "megatron",
        ),
        (listing("5", ["_CHECKPOINT_METADATA", "default/_METADATA"]), "orbax"),
        (listing("epoch=0-step=5.ckpt", ["epoch=0-step=5.ckpt"], is_dir=False), "lightning"),
        (listing("custom-5", ["weights.bin", "COMPLETE"]), "marker"),
        (listing("custom-5", ["weights.bin"]), "quiescent"),
    ],
)
def test_auto_picks_the_first_rule_that_recognises_each_checkpoint(
    snap: CheckpointListing, expected: str
) -> None:
    verdict = judge("auto", snap)
    assert verdict.layout == expected
    assert verdict.complete, verdict.reason


def test_auto_leaves_a_custom_checkpoint_dash_n_dir_to_quiescence() -> None:
    # Named like the Trainer's dirs, but holding none of the Trainer's own files.
    snap = listing("checkpoint-5", ["model.pt"])
    assert judge("auto", snap).layout == "quiescent"
    assert judge("auto", snap).complete


@pytest.mark.parametrize(
    "files",
    [["config.json"], ["config.json", "generation_config.json", "model.safetensors"]],
)
def test_auto_judges_a_save_killed_in_save_model_by_the_hf_rule(files: list[str]) -> None:
    # Killed before training_args.bin: only save_pretrained's files, quiet for ever.
    verdict = judge("auto", listing("checkpoint-5", files))
    assert (verdict.layout, verdict.complete) == ("hf", False)


def test_auto_judges_a_half_written_trainer_checkpoint_by_the_hf_rule() -> None:
    snap = listing("checkpoint-5", ["model.safetensors", "training_args.bin", "optimizer.pt"])
    verdict = judge("auto", snap)
    assert verdict.layout == "hf"
    assert not verdict.complete


def test_auto_uses_the_configured_marker_name() -> None:
    snap = listing("custom-5", ["weights.bin", "DONE"], age=1.0)
    settings = RuleSettings(marker="DONE")
    verdict = evaluate("auto", snap, NOW, settings)
    assert (verdict.layout, verdict.complete) == ("marker", True)


EMPTY_BY_LAYOUT = {
    "hf": listing("checkpoint-5", []),
    "dcp": listing("step-5", []),
    "deepspeed": listing("global_step5", [], trackers={"latest": "global_step5"}),
    "megatron": listing("iter_0000005", [], trackers={"latest_checkpointed_iteration.txt": "5"}),
    "lightning": listing("empty.ckpt", []),
    "orbax": listing("5", []),
    "marker": listing("custom", []),
    "quiescent": listing("custom", []),
}


@pytest.mark.parametrize("layout", [*sorted(RULES), "auto"])
def test_an_empty_directory_is_never_complete(layout: str) -> None:
    snap = EMPTY_BY_LAYOUT.get(layout, listing("custom", []))
    assert not judge(layout, snap, NOW + 10**6 * S).complete


@pytest.mark.parametrize(
    ("name", "is_dir", "expected"),
    [
        ("checkpoint-500", True, True),
        ("epoch=1-step=9.ckpt", False, True),
        ("100", True, True),
        (".ckptd", True, False),
        (".hidden.ckpt", False, False),
        ("latest", False, False),
        ("latest_checkpointed_iteration.txt", False, False),
        ("latest", True, True),  # a dir that happens to be named like a tracker
        ("zero_to_fp32.py", False, False),
        ("progress.txt", False, False),
        ("100.orbax-checkpoint-tmp-1733150000", True, False),
        ("tmp-checkpoint-500", True, False),
        ("last.ckpt.part", False, False),
        ("model.pt.tmp", False, False),
        ("model.pt~", False, False),
        ("tmp_save_500", True, False),
        ("TMP-500", True, False),
        ("temp.ckpt", False, False),
        ("ckpt-500.tmp", True, False),
        ("step_500_tmp", True, False),
        ("checkpoint-500.partial", True, False),
        ("checkpoint-500-inprogress", True, False),
        ("temperature-500", True, True),  # a word that starts like one is no temp name
        ("attempt-500", True, True),
        ("tmpl-500", True, True),
        ("", False, False),
    ],
)
def test_only_real_checkpoint_names_are_candidates(name: str, is_dir: bool, expected: bool) -> None:
    assert is_checkpoint_candidate(name, is_dir) is expected


# --- hf ---------------------------------------------------------------------------------


def test_hf_checkpoint_without_trainer_state_is_incomplete() -> None:
    snap = listing("checkpoint-500", [f for f in HF_FILES if f != "trainer_state.json"])
    verdict = judge("hf", snap)
    assert not verdict.complete
    assert verdict.recheck_after is None  # waiting for a file, not for time
    assert "trainer_state.json" in verdict.reason


def test_hf_checkpoint_with_incomplete_sentinel_is_incomplete() -> None:
    snap = listing("checkpoint-500", [*HF_FILES, "checkpoint-is-incomplete.txt"])
    verdict = judge("hf", snap)
    assert not verdict.complete
    assert "checkpoint-is-incomplete.txt" in verdict.reason


def test_hf_checkpoint_is_complete_once_trainer_state_is_written_and_settled() -> None:
    verdict = judge("hf", listing("checkpoint-500", HF_FILES))
    assert verdict.complete
    assert paths(verdict) == sorted(HF_FILES)


def test_hf_checkpoint_changed_within_settle_window_is_rechecked_after_the_rest() -> None:
    ages = dict.fromkeys(HF_FILES, LONG_AGO) | {"rng_state_1.pth": 0.5}
    verdict = judge("hf", listing("checkpoint-500", ages))
    assert not verdict.complete
    assert verdict.recheck_after == pytest.approx(1.5)
    later = judge("hf", listing("checkpoint-500", ages), NOW + int(1.5 * S))
    assert later.complete


def test_hf_checkpoint_with_a_rank_still_writing_is_incomplete() -> None:
    snap = listing("checkpoint-500", HF_FILES, writers=frozenset({"rng_state_3.pth"}))
    verdict = judge("hf", snap)
    assert not verdict.complete
    assert "rng_state_3.pth" in verdict.reason


@pytest.mark.parametrize(
    "weights",
    [
        "model.safetensors",
        "pytorch_model.bin",
        "model.safetensors.index.json",
        "adapter_model.safetensors",
        "pytorch_model_fsdp_0/__0_0.distcp",
        "global_step500/mp_rank_00_model_states.pt",
    ],
)
def test_hf_checkpoint_half_deleted_by_rotation_is_never_complete(weights: str) -> None:
    # Rotation's rmtree killed half-way: trainer_state.json left, the weights gone.
    leftover = ["trainer_state.json", "training_args.bin", "config.json"]
    verdict = judge("hf", listing("checkpoint-500", leftover))
    assert not verdict.complete and verdict.recheck_after is None
    assert "no model weights" in verdict.reason
    assert judge("hf", listing("checkpoint-500", [*leftover, weights])).complete


def test_hf_rule_judges_only_checkpoint_dash_n_directories() -> None:
    assert not judge("hf", listing("runs", HF_FILES)).complete
    assert not judge("hf", listing("checkpoint-5", HF_FILES, is_dir=False)).complete


def test_scratch_files_are_never_shipped() -> None:
    snap = listing("x", ["a.bin", "checkpoint-is-incomplete.txt", "sub/.metadata.tmp"])
    assert paths(judge("quiescent", snap)) == ["a.bin"]


# --- dcp --------------------------------------------------------------------------------

DCP_SHARDS = ["__0_0.distcp", "__1_0.distcp"]


def test_dcp_checkpoint_without_metadata_is_incomplete() -> None:
    verdict = judge("dcp", listing("step-100", DCP_SHARDS))
    assert not verdict.complete
    assert ".metadata" in verdict.reason


def test_dcp_checkpoint_with_only_metadata_tmp_is_incomplete() -> None:
    verdict = judge("dcp", listing("step-100", [*DCP_SHARDS, ".metadata.tmp"]))
    assert not verdict.complete
    assert ".metadata.tmp" in verdict.reason


def test_dcp_checkpoint_with_metadata_is_complete_and_ships_it() -> None:
    verdict = judge("dcp", listing("step-100", [*DCP_SHARDS, ".metadata"], age=0.0))
    assert verdict.complete  # the rename is the commit: no quiet window needed
    assert paths(verdict) == [".metadata", *DCP_SHARDS]


def test_dcp_resave_over_an_old_checkpoint_is_incomplete_while_shards_are_newer() -> None:
    ages = {".metadata": 100.0, "__0_0.distcp": 5.0, "__1_0.distcp": 200.0}
    verdict = judge("dcp", listing("step-100", ages))
    assert not verdict.complete
    assert "re-save" in verdict.reason


def test_dcp_resave_caught_between_metadata_tmp_and_rename_is_incomplete() -> None:
    snap = listing("step-100", [*DCP_SHARDS, ".metadata", ".metadata.tmp"])
    assert not judge("dcp", snap).complete


def test_dcp_with_a_shard_open_for_writing_is_incomplete() -> None:
    snap = listing("step-100", [*DCP_SHARDS, ".metadata"], writers=frozenset({"__1_0.distcp"}))
    assert not judge("dcp", snap).complete


def test_dcp_is_not_recognised_for_nested_shards_or_megatron_iterations() -> None:
    fsdp = listing(
        "step-5", ["pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/.metadata"]
    )
    megatron = listing("iter_0000005", ["__0_0.distcp", ".metadata", "common.pt"])
    assert not RULES["dcp"].recognises(fsdp)
    assert not RULES["dcp"].recognises(megatron)
    assert judge("auto", megatron).layout == "megatron"


# --- deepspeed --------------------------------------------------------------------------

DS_FILES = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
]


def test_deepspeed_tag_without_latest_is_incomplete() -> None:
    verdict = judge("deepspeed", listing("global_step10", DS_FILES))
    assert not verdict.complete
    assert "latest" in verdict.reason


def test_deepspeed_tag_named_by_latest_is_complete() -> None:
    snap = listing("global_step10", DS_FILES, trackers={"latest": "global_step10"})
    verdict = judge("deepspeed", snap)
    assert verdict.complete
    assert paths(verdict) == sorted(DS_FILES)


def test_deepspeed_tag_named_by_latest_waits_for_other_ranks_still_writing() -> None:
    # Rank 0 writes `latest` before the barrier: a sibling rank's shard can be in flight.
    trackers = {"latest": "global_step10"}
    busy = listing("global_step10", DS_FILES, trackers=trackers, writers=frozenset(DS_FILES[2:]))
    fresh = listing("global_step10", DS_FILES, trackers=trackers, age=0.5)
    assert not judge("deepspeed", busy).complete
    assert judge("deepspeed", fresh).recheck_after == pytest.approx(1.5)


def test_deepspeed_tag_newer_than_latest_is_incomplete() -> None:
    snap = listing("global_step20", DS_FILES, trackers={"latest": "global_step10"})
    assert not judge("deepspeed", snap).complete


def test_deepspeed_tag_older_than_latest_is_complete() -> None:
    snap = listing("global_step10", DS_FILES, trackers={"latest": "global_step20"})
    verdict = judge("deepspeed", snap)
    assert verdict.complete
    assert "global_step20" in verdict.reason


def test_deepspeed_truncated_latest_is_incomplete() -> None:
    snap = listing("global_step10", DS_FILES, trackers={"latest": ""})
    assert not judge("deepspeed", snap).complete


def test_deepspeed_custom_tag_is_complete_only_when_named_exactly() -> None:
    named = listing("best", DS_FILES, trackers={"latest": "best"})
    other = listing("best", DS_FILES, trackers={"latest": "global_step20"})
    assert judge("deepspeed", named).complete
    assert not judge("deepspeed", other).complete


def test_deepspeed_is_recognised_by_engine_files_before_latest_exists() -> None:
    assert RULES["deepspeed"].recognises(listing("global_step10", DS_FILES[:1]))
    assert not RULES["deepspeed"].recognises(listing("global_step10", ["weights.bin"]))
    assert judge("auto", listing("global_step10", DS_FILES)).layout == "deepspeed"


# --- megatron ---------------------------------------------------------------------------

MEG_FILES = ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]
MEG_TRACKER = "latest_checkpointed_iteration.txt"


@pytest.mark.parametrize(
    ("tracker", "complete"),
    [("500", True), ("1000", True), ("499", False), ("", False), ("garbage", False)],
)
def test_megatron_iteration_is_complete_once_the_tracker_reaches_it(
    tracker: str, complete: bool
) -> None:
    snap = listing("iter_0000500", MEG_FILES, trackers={MEG_TRACKER: tracker})
    assert judge("megatron", snap).complete is complete


def test_megatron_iteration_without_tracker_is_incomplete() -> None:
    assert not judge("megatron", listing("iter_0000500", MEG_FILES)).complete


def test_megatron_release_dir_is_complete_when_tracker_says_release() -> None:
    trackers = {MEG_TRACKER: "release"}
    assert judge("auto", listing("release", MEG_FILES, trackers=trackers)).complete
    assert not judge("megatron", listing("iter_0000500", MEG_FILES, trackers=trackers)).complete


def test_megatron_iteration_being_rewritten_is_incomplete_despite_tracker() -> None:
    snap = listing("iter_0000500", MEG_FILES, trackers={MEG_TRACKER: "900"}, age=0.1)
    verdict = judge("megatron", snap)
    assert not verdict.complete
    assert verdict.recheck_after == pytest.approx(1.9)


# --- lightning --------------------------------------------------------------------------

CKPT = "epoch=1-step=9.ckpt"


def test_lightning_file_closed_and_quiet_is_complete() -> None:
    verdict = judge("lightning", listing(CKPT, [CKPT], is_dir=False))
    assert verdict.complete
    assert paths(verdict) == [CKPT]


def test_lightning_file_open_for_writing_is_incomplete() -> None:
    snap = listing(CKPT, [CKPT], is_dir=False, writers=frozenset({CKPT}))
    assert not judge("lightning", snap).complete


def test_lightning_file_written_just_now_is_rechecked_after_the_settle_window() -> None:
    verdict = judge("lightning", listing(CKPT, [CKPT], is_dir=False, age=0.0))
    assert not verdict.complete
    assert verdict.recheck_after == pytest.approx(2.0)


def test_lightning_empty_file_is_incomplete() -> None:
    assert not judge("lightning", listing(CKPT, [CKPT], is_dir=False, size=0)).complete


def test_lightning_complete_when_writers_unknown_and_quiet() -> None:
    assert judge("lightning", listing(CKPT, [CKPT], is_dir=False, writers=None)).complete


def test_lightning_rule_does_not_take_a_directory_named_ckpt() -> None:
    snap = listing("last.ckpt", ["checkpoint/mp_rank_00_model_states.pt"])
    assert not RULES["lightning"].recognises(snap)
    assert not judge("lightning", snap).complete


# --- orbax ------------------------------------------------------------------------------

ORBAX_FILES = [
    "_CHECKPOINT_METADATA",
    "default/_METADATA",
    "default/manifest.ocdbt",
    "default/d/a1",
]


def test_orbax_tmp_dir_is_incomplete() -> None:
    snap = listing("100.orbax-checkpoint-tmp-1733150000", ORBAX_FILES)
    assert RULES["orbax"].recognises(snap)
    assert not judge("orbax", snap).complete


def test_orbax_renamed_step_dir_is_complete() -> None:
    verdict = judge("orbax", listing("100", ORBAX_FILES))
    assert verdict.complete
    assert paths(verdict) == sorted(ORBAX_FILES)


def test_orbax_step_dir_with_item_still_in_tmp_is_incomplete() -> None:
    snap = listing("100", ["_CHECKPOINT_METADATA", "default.orbax-checkpoint-tmp-17/_METADATA"])
    assert not judge("orbax", snap).complete


def test_orbax_commit_success_completes_at_once() -> None:
    snap = listing("100", [*ORBAX_FILES, "commit_success.txt"], age=0.0)
    assert judge("orbax", snap).complete


def test_orbax_is_recognised_by_its_files_or_tmp_siblings_not_by_digits_alone() -> None:
    plain = listing("100", ["weights.bin"])
    beside_tmp = listing("100", ["weights.bin"], siblings=frozenset({"200.orbax-checkpoint-tmp-9"}))
    assert not RULES["orbax"].recognises(plain)
    assert RULES["orbax"].recognises(beside_tmp)


def test_orbax_commit_success_with_a_writer_gives_no_zero_recheck_hint() -> None:
    snap = listing("100", [*ORBAX_FILES, "commit_success.txt"], writers=frozenset({"x"}))
    verdict = judge("orbax", snap)
    assert not verdict.complete
    assert verdict.recheck_after is None


# --- marker -----------------------------------------------------------------------------


def test_marker_checkpoint_without_marker_is_incomplete() -> None:
    assert not judge("marker", listing("custom-1", ["weights.bin"])).complete


def test_marker_checkpoint_is_complete_as_soon_as_the_marker_appears() -> None:
    snap = listing("custom-1", ["weights.bin", "COMPLETE"], age=0.0, writers=frozenset({"log"}))
    verdict = judge("marker", snap)
    assert verdict.complete
    assert paths(verdict) == ["COMPLETE", "weights.bin"]


def test_marker_alone_is_not_a_checkpoint() -> None:
    assert not judge("marker", listing("custom-1", ["COMPLETE"])).complete


def test_marker_must_sit_at_the_checkpoint_root() -> None:
    assert not judge("marker", listing("custom-1", ["weights.bin", "sub/COMPLETE"])).complete


# --- quiescent --------------------------------------------------------------------------


def test_quiescent_checkpoint_changed_recently_is_rechecked_after_the_rest() -> None:
    verdict = judge("quiescent", listing("custom", {"a": 100.0, "b": 4.0}))
    assert not verdict.complete
    assert verdict.recheck_after == pytest.approx(6.0)


def test_quiescent_checkpoint_with_a_writer_is_incomplete() -> None:
    snap = listing("custom", ["a", "b"], writers=frozenset({"b"}))
    verdict = judge("quiescent", snap)
    assert not verdict.complete
    assert verdict.recheck_after == pytest.approx(10.0)


def test_quiescent_checkpoint_quiet_and_unwritten_is_complete() -> None:
    assert judge("quiescent", listing("custom", {"a": 10.0, "b": 11.0})).complete


def test_quiescent_checkpoint_with_mtime_in_the_future_is_not_quiet() -> None:
    verdict = judge("quiescent", listing("custom", {"a": -30.0}))
    assert not verdict.complete
    assert verdict.recheck_after == pytest.approx(10.0)


# --- purity -----------------------------------------------------------------------------

_FORBIDDEN_MODULES = {"asyncio", "boto3", "aiohttp", "watchdog", "time", "datetime", "os"}


def test_layout_modules_do_no_io_and_read_no_clock() -> None:
    package = Path(ckptd.layouts.__file__).parent
    for module in sorted(package.glob("*.py")):
        tree = ast.parse(module.read_text(), filename=str(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            roots = {name.split(".")[0] for name in names}
            assert not roots & _FORBIDDEN_MODULES, f"{module.name} imports {roots}"


@pytest.mark.parametrize(
    "snap",
    [
        listing("notes.txt", ["notes.txt"], is_dir=False),
        listing("model.safetensors", ["model.safetensors"], is_dir=False),
        listing("runs", ["Dec02_host/events.out.tfevents.1"]),
    ],
)
def test_auto_never_ships_stray_output_files_without_a_step(snap: CheckpointListing) -> None:
    # HF's final model files and TensorBoard's runs/ sit beside the checkpoints.
    verdict = judge("auto", snap)
    assert not verdict.complete
    assert verdict.recheck_after is None


def test_named_quiescent_layout_still_ships_a_step_less_file() -> None:
    verdict = judge("quiescent", listing("notes.txt", ["notes.txt"], is_dir=False))
    assert verdict.layout == "quiescent"
