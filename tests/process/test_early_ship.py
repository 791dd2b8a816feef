"""Early shipping (``ckptd.sync.early``): files go before the checkpoint is complete, and
what commits is still exactly one complete checkpoint.

The end-to-end tests run the daemon as a real process against SeaweedFS on loopback.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ckptd.commit.single import Slot
from ckptd.core.checksum import crc32c
from ckptd.devtools.locals3 import LocalS3
from ckptd.layouts.base import CheckpointListing, FileEntry
from ckptd.repository import Repository, claim_key, object_key
from ckptd.runtime.logs import get_logger
from ckptd.storage.fs import FileStorage
from ckptd.sync import cleanup
from ckptd.sync.early import ready_files
from ckptd.sync.journal import Journal
from tests.process.test_sync_e2e import _assert_committed_identical, _keys
from tests.support.daemon import Daemon, committed_manifest, run_cli, wait_until
from tests.support.faultproxy import FaultProxy
from tests.support.writers import write_bytes, write_hf

MiB = 1024 * 1024
NS = 1_000_000_000


# -- which files may go (pure) ----------------------------------------------------------


def _listing(
    files: list[tuple[str, int, float]], open_for_write: frozenset[str] | None = frozenset()
) -> CheckpointListing:
    return CheckpointListing(
        name="checkpoint-1",
        is_dir=True,
        files=tuple(FileEntry(p, size, int(mtime * NS)) for p, size, mtime in files),
        open_for_write=open_for_write,
    )


def test_only_closed_quiet_files_not_sent_already_are_ready() -> None:
    now = 100 * NS
    listing = _listing(
        [
            ("model.safetensors", 10, 90.0),  # closed, quiet: goes
            ("optimizer.pt", 10, 99.0),  # open for writing
            ("rng_state.pth", 10, 99.8),  # closed 0.2 s ago: not yet
            ("scheduler.pt", 10, 80.0),  # sent already, unchanged
            ("config.json", 10, 80.0),  # sent already, since rewritten (other mtime)
            (".metadata.tmp", 10, 80.0),  # scratch: never
            ("busy.bin", 10, 80.0),  # being sent
        ],
        open_for_write=frozenset({"optimizer.pt"}),
    )
    done = {"scheduler.pt": (10, 80 * NS), "config.json": (10, 70 * NS)}
    ready, wait = ready_files(listing, done, {"busy.bin"}, now, settle_seconds=0.5)
    assert [f.path for f in ready] == ["config.json", "model.safetensors"]
    assert wait == pytest.approx(0.3)


def test_nothing_goes_where_proc_cannot_tell_or_from_a_file_checkpoint() -> None:
    unknown = _listing([("model.safetensors", 10, 1.0)], open_for_write=None)
    assert ready_files(unknown, {}, set(), 100 * NS) == ([], None)
    single = CheckpointListing("epoch=1.ckpt", False, (FileEntry("epoch=1.ckpt", 10, NS),))
    assert ready_files(single, {}, set(), 100 * NS) == ([], None)


def test_an_object_that_landed_before_its_journal_row_is_discarded_with_its_checkpoint(
    tmp_path: Path,
) -> None:
    """A crash between an object's PUT and its journal row: the checkpoint's slot was
    journalled when claimed and the checkpoint marked touched first, so the start-up sweep
    finds it, and deletes its whole slot."""
    store = FileStorage(tmp_path / "store")
    repo = Repository(store)
    journal = Journal(tmp_path / "state")
    journal.record_claim("run", Slot("checkpoint-3", "checkpoint-3", "checkpoint-3", ""))
    journal.touch("run", "checkpoint-3")
    for name, data in (("checkpoint-3", b"x" * 100), ("checkpoint-4", b"y" * 100)):
        key = object_key("run", name, "model.safetensors")
        store.put_bytes(key, data, crc32c=crc32c(data))
    (tmp_path / "run" / "checkpoint-4").mkdir(parents=True)  # still there locally: kept
    dirs = {"run": tmp_path / "run"}
    cleanup.discard_vanished(
        repo, journal, dirs, lambda run, name: False, get_logger(), whole_prefix=True
    )
    assert repo.list_objects("run", "checkpoint-3") == []
    assert len(repo.list_objects("run", "checkpoint-4")) == 1
    assert journal.uncommitted() == set()


def test_a_claim_made_just_before_a_crash_is_freed_when_its_checkpoint_is_gone(
    tmp_path: Path,
) -> None:
    """A crash between the claim's PUT and the first object (nothing touched, nothing
    sent): only the journal's claim knows of it, and the start-up sweep deletes the
    claim of a checkpoint deleted meanwhile, leaving nothing under its name."""
    store = FileStorage(tmp_path / "store")
    repo = Repository(store)
    journal = Journal(tmp_path / "state")
    journal.record_claim("run", Slot("checkpoint-5", "checkpoint-5", "checkpoint-5", ""))
    store.put_bytes(claim_key("run", "checkpoint-5"), b"{}", crc32c=crc32c(b"{}"))
    assert journal.uncommitted() == {("run", "checkpoint-5")}
    (tmp_path / "run").mkdir()
    cleanup.discard_vanished(
        repo,
        journal,
        {"run": tmp_path / "run"},
        lambda run, name: False,
        get_logger(),
        whole_prefix=True,
    )
    assert repo.list_objects("run", "checkpoint-5") == []
    assert journal.uncommitted() == set()


# -- end to end -------------------------------------------------------------------------


def _daemon(
    tmp_path: Path, local_s3: LocalS3, dest: str, root: Path, name: str = "daemon", **kw: Any
) -> Daemon:
    root.mkdir(exist_ok=True)
    watch = [{"dir": root, "settle_seconds": kw.pop("settle_seconds", 0.3)}]
    return Daemon.configured(
        tmp_path,
        name=name,
        watch=watch,
        dest=dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=tmp_path / "state",
        part_size_mib=5,
        **kw,
    )


def _at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _no_uploads(s3: Any, prefix: str) -> bool:
    return not s3.list_multipart_uploads(Bucket="ckpt", Prefix=prefix).get("Uploads", [])


def test_large_files_go_before_the_commit_record_and_commit_byte_identical(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    ckpt = root / "checkpoint-5"
    model, optimizer = 20 * MiB, 10 * MiB
    with _daemon(tmp_path, local_s3, s3_dest, root, max_upload_mib_per_s=10) as daemon:
        write_bytes(ckpt / "model.safetensors", model)
        (ckpt / "config.json").write_text('{"model_type": "gpt2"}')
        write_bytes(ckpt / "optimizer.pt", optimizer)
        started = wait_until(
            lambda: daemon.events_named(
                "early_upload_started", checkpoint="checkpoint-5", path="model.safetensors"
            ),
            30,
            "the model's early upload",
        )
        # The record appears while the model is usually still on its way (10 MiB/s: ~2 s;
        # a starved test process may see it done first: either way it went before the
        # record, which is what is asserted below).
        (ckpt / "trainer_state.json").write_text('{"global_step": 5}')
        record_written = (ckpt / "trainer_state.json").stat().st_mtime
        committed = wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-5"),
            60,
            "commit",
        )[0]
        sent = daemon.metric("ckptd_upload_bytes_total", run="run")
    assert _at(started[0]) < record_written
    # Model, config and optimizer went before the record: taken over in flight, or done.
    assert committed["early"] >= 1
    assert committed["early"] + committed["skipped"] == 3
    # Each byte went once: the ship that followed completion took the early objects.
    assert sent < model + optimizer + 64 * 1024
    _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)
    assert _no_uploads(s3_client, s3_prefix)


def test_default_settings_copy_a_file_equal_to_the_last_commits_instead_of_sending_it(
    tmp_path: Path, local_s3: LocalS3, fault_proxy: FaultProxy, s3_dest: str
) -> None:
    """README's promise with its example config (ship_early on, settle_seconds = 2, the
    defaults): a frozen base model equal to the last commit's is copied server-side
    even though it is closed and quiet long before the save completes (its early
    transfer makes the copy). Counted on the wire, by the fault proxy."""
    root = tmp_path / "run"
    root.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": root}],  # every [[watch]] setting at its default
        dest=s3_dest,
        endpoint_url=fault_proxy.url,
        state_dir=tmp_path / "state",
    )
    model = 24 * MiB
    with daemon:
        first = write_hf(root, 200, model_bytes=model)
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-200"),
            60,
            "the first commit",
            details=daemon.log_text,
        )
        fault_proxy.reset_counters()
        second = root / "checkpoint-300"
        second.mkdir()
        shutil.copyfile(first / "model.safetensors", second / "model.safetensors")
        write_bytes(second / "adapter.safetensors", 256 * 1024)
        # The model goes early (closed and quiet for 0.5 s; the rule waits 2 s more).
        wait_until(
            lambda: daemon.events_named(
                "early_upload_started", checkpoint="checkpoint-300", path="model.safetensors"
            ),
            30,
            "the model's early transfer",
            details=daemon.log_text,
        )
        (second / "trainer_state.json").write_text('{"global_step": 300}')
        (committed,) = wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-300"),
            60,
            "the second commit",
            details=daemon.log_text,
        )
        copied = daemon.metric("ckptd_copied_bytes_total", run="run")
    sent = fault_proxy.bytes_up
    assert sent < model // 2, f"{sent} bytes sent: the unchanged model was uploaded again"
    assert copied == model
    assert committed["copied"] == 1
    assert daemon.events_named("early_copied", checkpoint="checkpoint-300")


def test_a_file_replaced_after_its_early_copy_is_sent_again(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    """Copied early (equal to the last commit's), then replaced by other bytes of the
    same size with the mtime set back: only ctime and inode differ, and the copy must
    not commit for it."""
    root = tmp_path / "run"
    with _daemon(tmp_path, local_s3, s3_dest, root) as daemon:
        first = write_hf(root, 200, model_bytes=6 * MiB)
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-200"),
            60,
            "the first commit",
        )
        ckpt = root / "checkpoint-300"
        ckpt.mkdir()
        shutil.copyfile(first / "model.safetensors", ckpt / "model.safetensors")
        wait_until(
            lambda: daemon.events_named("early_copied", checkpoint="checkpoint-300"),
            30,
            "the model's early copy",
            details=daemon.log_text,
        )
        old = (ckpt / "model.safetensors").stat()
        write_bytes(ckpt / "model.new", 6 * MiB)
        os.utime(ckpt / "model.new", ns=(old.st_atime_ns, old.st_mtime_ns))
        os.replace(ckpt / "model.new", ckpt / "model.safetensors")
        (ckpt / "trainer_state.json").write_text('{"global_step": 300}')
        (committed,) = wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-300"),
            60,
            "the second commit",
            details=daemon.log_text,
        )
    assert committed["copied"] == 0
    _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)


def test_a_closed_file_goes_while_the_next_one_is_still_being_written(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    ckpt = root / "checkpoint-8"
    with _daemon(tmp_path, local_s3, s3_dest, root) as daemon:
        write_bytes(ckpt / "model.safetensors", 4 * MiB)
        # The optimizer is written on and on (a file event every 50 ms): the model,
        # closed, must still go early rather than wait for the burst of events to end.
        deadline = time.monotonic() + 15
        with open(ckpt / "optimizer.pt", "wb") as fh:
            while not daemon.events_named("early_upload_started", path="model.safetensors"):
                assert time.monotonic() < deadline, "the model did not go during the save"
                fh.write(os.urandom(64 * 1024))
                fh.flush()
                time.sleep(0.05)
        (ckpt / "trainer_state.json").write_text('{"global_step": 8}')
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-8"),
            60,
            "commit",
        )
    _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)


def test_file_replaced_after_its_early_upload_is_sent_again(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    ckpt = root / "checkpoint-6"
    size = 8 * MiB
    with _daemon(tmp_path, local_s3, s3_dest, root) as daemon:
        write_bytes(ckpt / "model.safetensors", size)
        write_bytes(ckpt / "optimizer.pt", size)
        wait_until(
            lambda: len(daemon.events_named("early_upload_done", checkpoint="checkpoint-6")) == 2,
            30,
            "both files sent early",
        )
        # The trainer writes the model again. The optimizer is replaced by a new file of
        # the same size, its mtime set back to the old one: only ctime and inode differ.
        with open(ckpt / "model.safetensors", "r+b") as fh:
            fh.write(os.urandom(MiB))
        old = (ckpt / "optimizer.pt").stat()
        write_bytes(ckpt / "optimizer.new", size)
        os.utime(ckpt / "optimizer.new", ns=(old.st_atime_ns, old.st_mtime_ns))
        os.replace(ckpt / "optimizer.new", ckpt / "optimizer.pt")
        (ckpt / "trainer_state.json").write_text('{"global_step": 6}')
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-6"),
            60,
            "commit",
        )
        sent = daemon.metric("ckptd_upload_bytes_total", run="run")
    assert sent >= 4 * size, "a changed file was not sent again"
    _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)


def test_checkpoint_deleted_before_completion_leaves_nothing_in_the_store(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    doomed = root / "checkpoint-7"
    with _daemon(
        tmp_path, local_s3, s3_dest, root, concurrency=2, max_upload_mib_per_s=8
    ) as daemon:
        write_bytes(doomed / "config.json", 2000)
        write_bytes(doomed / "model.safetensors", 30 * MiB)
        wait_until(
            lambda: (
                # config.json, a small file, goes in a batch (``ckptd.sync.lanes``).
                daemon.events_named("early_batch_done", checkpoint="checkpoint-7")
                and not _no_uploads(s3_client, s3_prefix)
            ),
            30,
            "an early object and a multipart upload in flight",
        )
        shutil.rmtree(doomed)  # save_total_limit rotation, before the record was written
        wait_until(
            lambda: daemon.events_named("checkpoint_discarded_before_complete"),
            30,
            "discard",
        )
        wait_until(
            lambda: (
                _keys(s3_client, f"{s3_prefix}/run/checkpoint-7/") == []
                and _no_uploads(s3_client, s3_prefix)
            ),
            10,
            "no object and no multipart upload left",
        )
        assert daemon.alive()
    assert committed_manifest(s3_client, s3_prefix, "run", "checkpoint-7") is None


def _save(ckpt: Path, rng: random.Random, step: int, rewrite: bool) -> None:
    """An HF-shaped save with pauses between files, maybe rewriting the model in place
    (a second save of the same step) before the record."""
    write_bytes(ckpt / "model.safetensors", 6 * MiB)
    time.sleep(rng.uniform(0.2, 0.8))
    write_bytes(ckpt / "optimizer.pt", 4 * MiB)
    time.sleep(rng.uniform(0.2, 0.8))
    if rewrite:
        with open(ckpt / "model.safetensors", "r+b") as fh:
            fh.seek(rng.randrange(5 * MiB))
            fh.write(os.urandom(MiB))
        time.sleep(rng.uniform(0.0, 0.5))
    (ckpt / "trainer_state.json").write_text(f'{{"global_step": {step}}}')


def test_kill_9_at_random_instants_never_commits_a_mixed_checkpoint(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    seed = int(os.environ.get("EARLY_KILL_SEED", time.time_ns() % 100000))
    print(f"seed {seed} (EARLY_KILL_SEED={seed} reproduces)")
    rng = random.Random(seed)
    root = tmp_path / "run"
    root.mkdir()
    settings = {"max_upload_mib_per_s": 12}
    daemon = _daemon(tmp_path, local_s3, s3_dest, root, name="d0", **settings).start()
    try:
        for i in range(1, 6):
            ckpt = root / f"checkpoint-{i}"
            rewrite, delete = rng.random() < 0.5, rng.random() < 0.25
            writer = threading.Thread(target=_save, args=(ckpt, rng, i, rewrite))
            writer.start()
            time.sleep(rng.uniform(0.0, 2.5))  # mid-save, or mid-ship after it
            daemon.kill9()
            writer.join()
            where = f"seed {seed}, checkpoint-{i} (rewrite={rewrite}, delete={delete})"
            if committed_manifest(s3_client, s3_prefix, "run", ckpt.name) is not None:
                # Committed before the kill: it must be whole, and stays whatever happens.
                _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)
                delete = False
            if delete:
                shutil.rmtree(ckpt)  # deleted before completion, while no daemon ran
            daemon = _daemon(tmp_path, local_s3, s3_dest, root, name=f"d{i}", **settings)
            daemon.start()
            if delete:
                wait_until(
                    lambda i=i: (
                        _keys(s3_client, f"{s3_prefix}/run/checkpoint-{i}/") == []
                        and _no_uploads(s3_client, s3_prefix)
                    ),
                    30,
                    f"nothing left of {where}",
                )
                assert committed_manifest(s3_client, s3_prefix, "run", ckpt.name) is None, where
                continue
            wait_until(
                lambda i=i: committed_manifest(s3_client, s3_prefix, "run", f"checkpoint-{i}"),
                60,
                f"commit of {where}",
            )
            try:
                _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from exc
        wait_until(lambda: _no_uploads(s3_client, s3_prefix), 10, "no multipart upload left")
        logs = [Path(tmp_path / f"d{i}.log").read_text() for i in range(6)]
        assert any("early_upload_started" in text for text in logs), "nothing went early"
    finally:
        if daemon.alive():
            daemon.kill9()


def test_run_once_with_early_uploads_in_flight_stops_them_cleanly(tmp_path: Path) -> None:
    """``--once`` over an incomplete checkpoint whose files are ready to go early: the
    early uploads are stopped before the transfer pool closes (no "Task exception was
    never retrieved" traceback), and the exit says nothing failed."""
    run = tmp_path / "watch" / "run"
    ckpt = run / "checkpoint-1"
    write_bytes(ckpt / "model.bin", 24 * MiB)  # not weights by HF's names: incomplete
    (ckpt / "trainer_state.json").write_text("{}")
    old = time.time() - 60
    for f in ckpt.iterdir():
        os.utime(f, (old, old))
    store = tmp_path / "store"
    store.mkdir()
    config = tmp_path / "ckptd.toml"
    config.write_text(
        f'[[watch]]\ndir = "{run}"\nsettle_seconds = 0\n'
        f'[destination]\nurl = "file://{store}"\nmax_upload_mib_per_s = 20\n'
        f'[preemption]\nprovider = "none"\n[metrics]\nlisten = "127.0.0.1:0"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n'
    )
    result = run_cli("run", "--once", config=config, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "early_upload_started" in result.stderr  # the case this test is about
    assert "Traceback" not in result.stderr and "never retrieved" not in result.stderr
    assert not (store / "run" / "checkpoint-1" / "ckptd.manifest.json").exists()
