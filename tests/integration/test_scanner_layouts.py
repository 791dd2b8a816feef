"""Scanner + rules on real directories, written in each framework's own order.

Each write-order test scans after every step and asserts the rule calls the checkpoint
incomplete (even long after the last write, so not merely for want of time) until the
framework's final step, then complete. Time is passed as ``now_ns``; nothing sleeps.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptd.layouts import Completion, RuleSettings, evaluate
from ckptd.layouts.base import CheckpointListing
from ckptd.sync import scanner
from ckptd.sync.scanner import list_candidates, open_files_for_write, snapshot

S = 1_000_000_000
SETTINGS = RuleSettings(quiescence_seconds=10.0, marker="COMPLETE", settle_seconds=2.0)
# Later than the settle window, sooner than the quiescence window: what `auto` sees a few
# seconds after a write, when the fallback must not yet take a half-written checkpoint.
JUST_SETTLED = 2.5
LONG_AFTER = 3600.0

Step = Callable[[Path], None]


def write(path: Path, data: bytes = b"\x00" * 64) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def write_all(directory: Path, *names: str) -> None:
    for name in names:
        write(directory / name)


def scan(watch: Path, name: str) -> CheckpointListing:
    snap = snapshot(watch, name)
    assert snap is not None, f"{name} vanished"
    return snap


def judge(layout: str, watch: Path, name: str, after: float) -> Completion:
    """The verdict ``after`` seconds past the newest write."""
    snap = scan(watch, name)
    return evaluate(layout, snap, snap.newest_mtime_ns + int(after * S), SETTINGS)


def run_write_order(layout: str, watch: Path, name: str, steps: list[Step]) -> None:
    """Apply ``steps``; incomplete after each but the last, complete after the last."""
    after = JUST_SETTLED if layout == "auto" else LONG_AFTER
    watch.mkdir(exist_ok=True)
    for i, step in enumerate(steps, start=1):
        step(watch)
        verdict = judge(layout, watch, name, after)
        if i < len(steps):
            assert not verdict.complete, f"complete after step {i}/{len(steps)}: {verdict.reason}"
        else:
            assert verdict.complete, verdict.reason
            assert name in list_candidates(watch)


# --- Hugging Face Trainer ---------------------------------------------------------------


def hf_steps(name: str = "checkpoint-500") -> list[Step]:
    ck = name
    return [
        lambda w: (w / ck).mkdir(),
        # save_model: weights, config, then training_args.bin
        lambda w: write(w / ck / "model.safetensors"),
        lambda w: write_all(w / ck, "config.json", "training_args.bin"),
        # _save_optimizer_and_scheduler, _save_rng_state (per rank)
        lambda w: write_all(w / ck, "optimizer.pt", "scheduler.pt"),
        lambda w: write_all(w / ck, "rng_state_0.pth", "rng_state_1.pth"),
        # trainer_state.json last, by the main process
        lambda w: write(w / ck / "trainer_state.json", b"{}"),
    ]


@pytest.mark.parametrize("layout", ["hf", "auto"])
def test_hf_checkpoint_is_incomplete_until_trainer_state_json_is_written(
    tmp_path: Path, layout: str
) -> None:
    run_write_order(layout, tmp_path / "out", "checkpoint-500", hf_steps())


def test_hf_jit_checkpoint_is_incomplete_until_its_sentinel_is_removed(tmp_path: Path) -> None:
    sentinel = "checkpoint-is-incomplete.txt"
    steps = hf_steps()
    steps.insert(1, lambda w: write(w / "checkpoint-500" / sentinel))
    steps.append(lambda w: (w / "checkpoint-500" / sentinel).unlink())
    run_write_order("hf", tmp_path / "out", "checkpoint-500", steps)


def test_hf_checkpoint_just_written_is_rechecked_after_the_settle_window(tmp_path: Path) -> None:
    watch = tmp_path / "out"
    watch.mkdir()
    for step in hf_steps():
        step(watch)
    fresh = judge("hf", watch, "checkpoint-500", 0.0)
    assert not fresh.complete
    assert fresh.recheck_after == pytest.approx(SETTINGS.settle_seconds)


def test_hf_checkpoint_rotated_away_gives_no_snapshot(tmp_path: Path) -> None:
    watch = tmp_path / "out"
    watch.mkdir()
    for step in hf_steps():
        step(watch)
    shutil.rmtree(watch / "checkpoint-500")  # save_total_limit
    assert snapshot(watch, "checkpoint-500") is None


# --- torch.distributed.checkpoint -------------------------------------------------------


@pytest.mark.parametrize("layout", ["dcp", "auto"])
def test_dcp_checkpoint_is_incomplete_until_metadata_is_renamed_into_place(
    tmp_path: Path, layout: str
) -> None:
    ck = "step-100"
    steps: list[Step] = [
        lambda w: (w / ck).mkdir(),
        lambda w: write(w / ck / "__0_0.distcp"),  # write_data, rank 0
        lambda w: write(w / ck / "__1_0.distcp"),  # write_data, rank 1
        lambda w: write(w / ck / ".metadata.tmp", b"pickled"),  # finish(): tmp, fsync
        lambda w: os.rename(w / ck / ".metadata.tmp", w / ck / ".metadata"),  # then rename
    ]
    run_write_order(layout, tmp_path / "ckpt", ck, steps)
    verdict = judge(layout, tmp_path / "ckpt", ck, LONG_AFTER)
    assert [f.path for f in verdict.files] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


# --- DeepSpeed --------------------------------------------------------------------------


def ds_steps(tag: str) -> list[Step]:
    return [
        lambda w: (w / tag).mkdir(),
        lambda w: write(w / tag / "mp_rank_00_model_states.pt"),
        lambda w: write(w / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        lambda w: write(w / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        lambda w: write(w / "zero_to_fp32.py", b"#!"),  # recovery script, beside the tags
        lambda w: write(w / "latest", tag.encode()),  # rank 0, after its own writes
    ]


@pytest.mark.parametrize("layout", ["deepspeed", "auto"])
def test_deepspeed_tag_is_incomplete_until_latest_names_it(tmp_path: Path, layout: str) -> None:
    watch = tmp_path / "ds"
    run_write_order(layout, watch, "global_step10", ds_steps("global_step10"))
    assert list_candidates(watch) == ["global_step10"]  # not latest, not zero_to_fp32.py


def test_deepspeed_older_tag_stays_complete_after_latest_moves_on(tmp_path: Path) -> None:
    watch = tmp_path / "ds"
    run_write_order("deepspeed", watch, "global_step10", ds_steps("global_step10"))
    run_write_order("deepspeed", watch, "global_step20", ds_steps("global_step20"))
    assert judge("deepspeed", watch, "global_step10", LONG_AFTER).complete
    assert scan(watch, "global_step10").trackers == {"latest": "global_step20"}


# --- Megatron-LM ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["megatron", "auto"])
def test_megatron_iteration_is_incomplete_until_the_tracker_reaches_it(
    tmp_path: Path, layout: str
) -> None:
    ck = "iter_0000500"
    tracker = "latest_checkpointed_iteration.txt"

    def begin(w: Path) -> None:
        write(w / tracker, b"250\n")  # from the previous save
        (w / ck).mkdir()

    steps: list[Step] = [
        begin,
        lambda w: write(w / ck / "mp_rank_00" / "model_optim_rng.pt"),
        lambda w: write(w / ck / "mp_rank_01" / "model_optim_rng.pt"),
        lambda w: write(w / "progress.txt", b"Saved checkpoint\n"),  # --log-progress
        lambda w: write(w / tracker, b"500"),  # rank 0 after the barrier
    ]
    watch = tmp_path / "meg"
    run_write_order(layout, watch, ck, steps)
    assert list_candidates(watch) == [ck]


# --- orbax ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["orbax", "auto"])
def test_orbax_step_is_incomplete_until_its_tmp_dir_is_renamed(tmp_path: Path, layout: str) -> None:
    watch = tmp_path / "jax"
    tmp = "100.orbax-checkpoint-tmp-1733150000"
    watch.mkdir()
    write(watch / tmp / "default" / "_METADATA")
    write(watch / tmp / "default" / "manifest.ocdbt")
    write(watch / tmp / "default" / "d" / "0a1b")
    write(watch / tmp / "_CHECKPOINT_METADATA", b"{}")
    assert list_candidates(watch) == []  # still being written, under its tmp name
    assert not evaluate("orbax", scan(watch, tmp), 2**62, SETTINGS).complete
    os.rename(watch / tmp, watch / "100")  # the commit
    assert list_candidates(watch) == ["100"]
    after = JUST_SETTLED if layout == "auto" else LONG_AFTER
    assert judge(layout, watch, "100", after).complete


def test_orbax_commit_file_step_waits_until_commit_success_or_quiet(tmp_path: Path) -> None:
    # Where a rename is not atomic (GCS, CommitFileTemporaryPath) orbax writes in place
    # and ends with commit_success.txt: complete at once then, and never while an item
    # is still under its tmp name.
    ck = "100"
    watch = tmp_path / "jax"
    watch.mkdir()
    write(watch / ck / "_CHECKPOINT_METADATA", b"{}")
    assert not judge("orbax", watch, ck, 0.0).complete
    write(watch / ck / "default.orbax-checkpoint-tmp-5" / "_METADATA")
    assert not judge("orbax", watch, ck, LONG_AFTER).complete
    os.rename(watch / ck / "default.orbax-checkpoint-tmp-5", watch / ck / "default")
    assert not judge("orbax", watch, ck, 0.0).complete
    write(watch / ck / "commit_success.txt", b"Checkpoint commit was successful")
    assert judge("orbax", watch, ck, 0.0).complete


# --- Lightning --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["lightning", "auto"])
def test_lightning_checkpoint_appears_whole_through_fsspec_commit(
    tmp_path: Path, layout: str
) -> None:
    watch = tmp_path / "lightning"
    watch.mkdir()
    name = "epoch=0-step=9.ckpt"
    staged = tmp_path / "systemp" / "tmpa1b2c3"  # tempfile.mkstemp() in _atomic_save
    write(staged, b"torch-zip" * 100)
    assert list_candidates(watch) == []
    os.replace(staged, watch / name)  # fs.transaction commit: shutil.move
    after = JUST_SETTLED if layout == "auto" else LONG_AFTER
    assert judge(layout, watch, name, after).complete


def test_lightning_checkpoint_being_copied_in_is_incomplete(tmp_path: Path) -> None:
    # shutil.move across filesystems copies into the final name: visible and open.
    watch = tmp_path / "lightning"
    watch.mkdir()
    name = "last.ckpt"
    with open(watch / name, "wb") as f:
        f.write(b"half")
        f.flush()
        busy = scan(watch, name)
        if busy.open_for_write is None:
            pytest.skip("/proc not usable here")
        assert busy.open_for_write == frozenset({name})
        assert not evaluate("lightning", busy, 2**62, SETTINGS).complete
    assert judge("lightning", watch, name, LONG_AFTER).complete


# --- marker and quiescent ---------------------------------------------------------------


@pytest.mark.parametrize("layout", ["marker", "auto"])
def test_marker_checkpoint_is_incomplete_until_the_marker_appears(
    tmp_path: Path, layout: str
) -> None:
    ck = "ckpt_0007"
    steps: list[Step] = [
        lambda w: write(w / ck / "weights.bin"),
        lambda w: write(w / ck / "opt" / "state.bin"),
        lambda w: write(w / ck / "COMPLETE", b""),
    ]
    run_write_order(layout, tmp_path / "custom", ck, steps)


def test_quiescent_checkpoint_is_incomplete_within_the_window(tmp_path: Path) -> None:
    watch = tmp_path / "custom"
    write(watch / "run-3" / "weights.bin")
    inside = judge("quiescent", watch, "run-3", 9.0)
    assert not inside.complete
    assert inside.recheck_after == pytest.approx(1.0)
    assert judge("quiescent", watch, "run-3", 10.0).complete


# --- writers seen through /proc ---------------------------------------------------------


@pytest.fixture
def child_holding_open() -> Iterator[Callable[[Path, str], subprocess.Popen[str]]]:
    """Start processes that open a file (mode given) and wait on stdin; end them by PID."""
    started: list[subprocess.Popen[str]] = []

    def start(path: Path, mode: str) -> subprocess.Popen[str]:
        code = (
            "import sys\n"
            f"f = open({str(path)!r}, {mode!r})\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"  # synchronise on the pipe
        return proc

    yield start
    for proc in started:
        end(proc)


def end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


def require_proc(root: Path) -> None:
    if open_files_for_write(root) is None:
        pytest.skip("/proc not usable here")


def test_file_held_open_for_writing_by_another_process_keeps_quiescent_incomplete(
    tmp_path: Path, child_holding_open: Callable[[Path, str], subprocess.Popen[str]]
) -> None:
    watch = tmp_path / "custom"
    write(watch / "run-3" / "weights.bin")
    write(watch / "run-3" / "sub" / "shard.bin")
    require_proc(watch)
    proc = child_holding_open(watch / "run-3" / "sub" / "shard.bin", "ab")
    busy = scan(watch, "run-3")
    assert busy.open_for_write == frozenset({"sub/shard.bin"})
    assert not evaluate("quiescent", busy, 2**62, SETTINGS).complete
    end(proc)
    assert judge("quiescent", watch, "run-3", LONG_AFTER).complete


def test_lightning_file_held_open_for_writing_by_another_process_is_incomplete(
    tmp_path: Path, child_holding_open: Callable[[Path, str], subprocess.Popen[str]]
) -> None:
    watch = tmp_path / "lightning"
    write(watch / "last.ckpt", b"torch-zip")
    require_proc(watch)
    proc = child_holding_open(watch / "last.ckpt", "r+b")
    busy = scan(watch, "last.ckpt")
    assert busy.open_for_write == frozenset({"last.ckpt"})
    for layout in ("lightning", "quiescent", "auto"):
        assert not evaluate(layout, busy, 2**62, SETTINGS).complete
    end(proc)
    assert judge("lightning", watch, "last.ckpt", LONG_AFTER).complete


def test_file_open_only_for_reading_is_not_a_writer(
    tmp_path: Path, child_holding_open: Callable[[Path, str], subprocess.Popen[str]]
) -> None:
    watch = tmp_path / "custom"
    write(watch / "run-3" / "weights.bin")
    require_proc(watch)
    child_holding_open(watch / "run-3" / "weights.bin", "rb")
    assert scan(watch, "run-3").open_for_write == frozenset()
    assert judge("quiescent", watch, "run-3", LONG_AFTER).complete


def test_open_files_for_write_is_none_without_proc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scanner, "_PROC", str(tmp_path / "no-proc"))
    assert open_files_for_write(tmp_path) is None


# --- the walk itself --------------------------------------------------------------------


def test_snapshot_lists_regular_files_by_relative_path_and_follows_file_links(
    tmp_path: Path,
) -> None:
    watch = tmp_path / "w"
    write(watch / "ck" / "a.bin", b"12345")
    write(watch / "ck" / "sub" / "deeper" / "b.bin", b"1")
    write(tmp_path / "outside" / "secret.bin")
    os.symlink(tmp_path / "outside" / "secret.bin", watch / "ck" / "link.bin")
    os.symlink(tmp_path / "outside", watch / "ck" / "linkdir")
    snap = scan(watch, "ck")
    assert snap.is_dir
    # A link to a file is that file (as a copy takes it); a link to a directory is never
    # followed, and reported instead of silently left out.
    assert [(f.path, f.size) for f in snap.files] == [
        ("a.bin", 5),
        ("link.bin", 64),
        ("sub/deeper/b.bin", 1),
    ]
    assert snap.unshippable == ("linkdir",)
    st = os.stat(watch / "ck" / "a.bin")
    assert snap.files[0].mtime_ns == st.st_mtime_ns


def test_snapshot_of_a_file_checkpoint_is_one_entry_named_after_it(tmp_path: Path) -> None:
    write(tmp_path / "model.ckpt", b"abc")
    snap = scan(tmp_path, "model.ckpt")
    assert not snap.is_dir
    assert [(f.path, f.size) for f in snap.files] == [("model.ckpt", 3)]


def test_snapshot_reads_trackers_and_siblings(tmp_path: Path) -> None:
    write(tmp_path / "global_step10" / "mp_rank_00_model_states.pt")
    write(tmp_path / "latest", b"global_step10\n")
    write(tmp_path / "latest_checkpointed_iteration.txt", b"7" * 10_000)
    snap = scan(tmp_path, "global_step10")
    assert snap.trackers["latest"] == "global_step10"
    assert snap.trackers["latest_checkpointed_iteration.txt"] == "7" * 4096  # capped
    assert snap.siblings == {"global_step10", "latest", "latest_checkpointed_iteration.txt"}


def test_tracker_that_is_not_a_regular_file_is_ignored(tmp_path: Path) -> None:
    write(tmp_path / "global_step10" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").mkdir()
    assert scan(tmp_path, "global_step10").trackers == {}


def test_snapshot_of_a_missing_child_is_none(tmp_path: Path) -> None:
    assert snapshot(tmp_path, "checkpoint-1") is None


def test_snapshot_of_a_symlinked_child_is_none(tmp_path: Path) -> None:
    write(tmp_path / "real" / "a.bin")
    os.symlink(tmp_path / "real", tmp_path / "checkpoint-1")
    assert snapshot(tmp_path, "checkpoint-1") is None


def racing_scandir(monkeypatch: pytest.MonkeyPatch, when: str, action: Callable[[], None]) -> None:
    """Make the scanner's scandir of directory ``when`` run ``action`` after reading it."""
    real = os.scandir
    fired: list[bool] = []

    def scandir(path: str) -> Iterator[os.DirEntry[str]]:
        if str(path) != when or fired:
            return real(path)
        fired.append(True)
        entries = list(real(path))
        action()
        return iter(entries)

    monkeypatch.setattr(os, "scandir", scandir)  # the scanner looks it up on each call


def test_checkpoint_deleted_mid_walk_gives_no_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoint-1"
    write(root / "a.bin")
    write(root / "sub" / "b.bin")
    racing_scandir(monkeypatch, str(root), lambda: shutil.rmtree(root))
    assert snapshot(tmp_path, "checkpoint-1") is None


def test_checkpoint_replaced_mid_walk_gives_no_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoint-1"
    write(root / "a.bin")

    def replace() -> None:
        os.rename(root, tmp_path / "old")  # keeps the old inode alive: no reuse
        write(root / "a.bin")

    racing_scandir(monkeypatch, str(root), replace)
    assert snapshot(tmp_path, "checkpoint-1") is None


def test_file_vanishing_mid_walk_counts_as_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run-1"
    write(root / "a.bin")
    write(root / "b.bin")
    racing_scandir(monkeypatch, str(root), lambda: (root / "b.bin").unlink())
    snap = scan(tmp_path, "run-1")
    assert [f.path for f in snap.files] == ["a.bin"]
    assert snap.open_for_write is not None and "b.bin" in snap.open_for_write
    assert not evaluate("quiescent", snap, 2**62, SETTINGS).complete


def test_list_candidates_is_sorted_and_skips_trackers_dot_entries_temps_and_links(
    tmp_path: Path,
) -> None:
    for d in ("checkpoint-20", "checkpoint-100", ".ckptd", "5.orbax-checkpoint-tmp-1"):
        (tmp_path / d).mkdir()
    for f in ("latest", "last.ckpt", "a.ckpt.part", ".hidden"):
        write(tmp_path / f)
    os.symlink(tmp_path / "last.ckpt", tmp_path / "best.ckpt")
    os.mkfifo(tmp_path / "pipe")
    assert list_candidates(tmp_path) == ["checkpoint-100", "checkpoint-20", "last.ckpt"]


def test_list_candidates_of_a_missing_watch_dir_is_empty(tmp_path: Path) -> None:
    assert list_candidates(tmp_path / "not-yet") == []


# --- symlinks inside a checkpoint -----------------------------------------------------------


def test_a_link_to_a_regular_file_is_shipped_as_that_file(tmp_path: Path) -> None:
    outside = tmp_path / "shared" / "tokenizer.json"
    write(outside, b"x" * 1234)
    ckpt = tmp_path / "run" / "checkpoint-5"
    write_all(ckpt, "model.safetensors", "trainer_state.json")
    (ckpt / "tokenizer.json").symlink_to(outside)
    listing = snapshot(tmp_path / "run", "checkpoint-5")
    assert listing is not None and listing.unshippable == ()
    (linked,) = [f for f in listing.files if f.path == "tokenizer.json"]
    assert linked.size == 1234  # the target's, as a copy would take it


@pytest.mark.parametrize("kind", ["dangling", "directory"])
def test_a_link_that_cannot_be_shipped_keeps_the_checkpoint_from_committing(
    tmp_path: Path, kind: str
) -> None:
    ckpt = tmp_path / "run" / "checkpoint-5"
    write_all(ckpt, "model.safetensors", "trainer_state.json")
    target = tmp_path / ("gone" if kind == "dangling" else "dataset")
    if kind == "directory":
        write_all(target, "shard-0.bin")
    (ckpt / "extra").symlink_to(target)
    listing = snapshot(tmp_path / "run", "checkpoint-5")
    assert listing is not None
    assert listing.unshippable == ("extra",)
    assert "extra" not in {f.path for f in listing.files}
    # Well past any quiet window: still refused, with the entry named.
    verdict = evaluate("auto", listing, listing.newest_mtime_ns + 10**12, RuleSettings())
    assert not verdict.complete
    assert "extra" in verdict.reason and "cannot be shipped" in verdict.reason
