"""No exception nobody handles, whatever the daemon meets (issue 44, items 7 and 8).

The daemon runs as a real process with ``PYTHONASYNCIODEBUG=1`` and every warning shown
(ResourceWarning as an error), through real faults: its ``file://`` tier's mount turning
read-only while a checkpoint is being saved, its state dir's goodput journal read-only
for a while (a bind mount remounted ro: sqlite's open database keeps the kernel from
remounting the whole state dir), its state dir full (a small tmpfs, filled), a full
``file://`` tier, files deleted and truncated mid-upload, SeaweedFS killed and started
again, and SIGTERM mid-upload. Each test fails on any "Task exception
was never retrieved", unraisable exception, unclosed resource or bare traceback in the
daemon's output, and on any exit code but 0. Where the tier fails, ``ckptd_tier_up``
drops within 5 s of the first failing request, early shipping's claim included, and
``/readyz`` and ``ckptd status`` agree. Mounting needs root: skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.conftest import BUCKET
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.mounts import bind_mount, fill, set_read_only, tmpfs
from tests.support.writers import write_bytes

MiB = 1024 * 1024
RUN = "run"
# What asyncio and the interpreter say of an exception or a resource nobody handled.
UNHANDLED = (
    "never retrieved",
    "Exception ignored",
    "ResourceWarning",
    "was never awaited",
    "Task was destroyed",
)
FAULT_ENV = {
    "PYTHONASYNCIODEBUG": "1",
    "PYTHONWARNINGS": "default,error::ResourceWarning",
}


def _at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _assert_nothing_unhandled(daemon: Daemon) -> None:
    """No unhandled exception or resource in the output; a traceback only inside a log
    line that said what failed (``exc_info``), never bare on stderr."""
    text = daemon.log_text()
    found = [word for word in UNHANDLED if word in text]
    bare = [
        line
        for line in text.splitlines()
        if not line.startswith("{") and "Traceback (most recent call last)" in line
    ]
    assert not found and not bare, f"unhandled in the daemon's output ({found}):\n{text[-8000:]}"


def _save_early(root: Path, step: int, model_bytes: int = 256 * 1024) -> Path:
    """A Hugging Face save in progress: its model and config, closed, no trainer state."""
    ckpt = root / f"checkpoint-{step}"
    write_bytes(ckpt / "model.safetensors", model_bytes)
    (ckpt / "config.json").write_text('{"model_type": "gpt2"}')
    return ckpt


def _complete(ckpt: Path, step: int) -> None:
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def _committed(daemon: Daemon, step: int, timeout: float = 30) -> None:
    wait_until(
        lambda: daemon.events_named("checkpoint_committed", checkpoint=f"checkpoint-{step}"),
        timeout,
        f"checkpoint-{step} committed",
        details=lambda: daemon.log_text()[-4000:],
    )


def _tier_drops_within_5s(daemon: Daemon, tier: str, what: str) -> None:
    """``ckptd_tier_up{tier}`` 0 within 5 s of the first request that failed; ``/readyz``,
    ``/v1/status`` and ``ckptd status`` say the same."""
    failed = wait_until(
        lambda: daemon.events_named("destination_request_failed", tier=tier),
        30,
        f"a failed request to the {tier} tier ({what})",
        details=lambda: daemon.log_text()[-4000:],
    )[0]
    wait_until(
        lambda: daemon.metric("ckptd_tier_up", tier=tier) == 0,
        15,
        f"ckptd_tier_up{{tier={tier}}} 0",
        details=lambda: daemon.log_text()[-4000:],
    )
    down = daemon.events_named("destination_unusable", tier=tier)[-1]
    assert _at(down) - _at(failed) < 5.0, (failed, down)
    status = daemon.get_json("/v1/status")
    assert status["destination"]["ok"] is False
    assert status["tiers"][tier]["destination"]["ok"] is False
    try:
        daemon.get_json("/readyz")
        raise AssertionError("/readyz said ready with its destination down")
    except Exception as exc:  # noqa: BLE001 - urllib's HTTPError: 503
        assert "503" in str(exc), exc
    cli = run_cli("status", "--json", config=daemon.config, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["tiers"][tier]["destination"]["ok"] is False


@pytest.fixture
def state_volume(tmp_path: Path) -> Iterator[Path]:
    """The state dir on a 24 MiB tmpfs, its goodput journal on a bind mount of its own."""
    with tmpfs(tmp_path / "state", 24) as state, bind_mount(state / "goodput"):
        yield state


def test_file_tier_and_state_dir_faults_leave_nothing_unhandled(
    tmp_path: Path, state_volume: Path
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    with bind_mount(tmp_path / "nfs") as nfs:
        daemon = Daemon.configured(
            tmp_path,
            watch=[{"dir": root, "run_id": RUN, "settle_seconds": 0.3}],
            dest=f"file://{nfs}",
            name="daemon",
            state_dir=state_volume,
            part_size_mib=5,
            max_upload_mib_per_s=16,
        )
        text = daemon.config.read_text().replace("[destination]\n", '[destination]\nname = "nfs"\n')
        daemon.config.write_text(text)
        daemon.env.update(FAULT_ENV)
        goodput = state_volume / "goodput"
        with daemon:
            log = lambda: daemon.log_text()[-4000:]  # noqa: E731
            # A commit the ledger's journal records (one committed within the second
            # the daemon started at may not be: its committed_at has whole seconds).
            journal = goodput / f"{RUN}.jsonl"
            for step in (100, 101, 102):
                ckpt = _save_early(root, step)
                _complete(ckpt, step)
                _committed(daemon, step)
                with contextlib.suppress(AssertionError):
                    wait_until(
                        lambda: journal.exists() and '"commit"' in journal.read_text(),
                        3,
                        "the commit in the ledger's journal",
                    )
                    break
            assert '"commit"' in journal.read_text()

            # The goodput journal read-only over its first shipping (15 s after the
            # start): the records of the commit are shipped, their mark cannot be
            # written. The ledger goes on, and ships again once it can.
            set_read_only(goodput, True)
            wait_until(
                lambda: daemon.events_named("goodput_ship_unmarked"),
                30,
                "a ledger shipped while its journal is read-only",
                details=log,
            )
            set_read_only(goodput, False)

            # The tier's mount turns read-only while a checkpoint is being saved: early
            # shipping's claim is refused, and the tier is down within 5 s.
            set_read_only(nfs, True)
            ckpt = _save_early(root, 200)
            _tier_drops_within_5s(daemon, "nfs", "early shipping's claim")
            assert daemon.events_named("early_ship_failed", checkpoint="checkpoint-200")
            set_read_only(nfs, False)
            wait_until(lambda: daemon.metric("ckptd_tier_up", tier="nfs") == 1, 20, "nfs up")
            _complete(ckpt, 200)
            _committed(daemon, 200)

            # The state dir fills up while a checkpoint is being saved: the journal's
            # writes fail (sqlite: database or disk is full), and it ships once there is
            # room again.
            filler = fill(state_volume)
            ckpt = _save_early(root, 300)
            wait_until(
                lambda: any(
                    daemon.events_named(event, checkpoint="checkpoint-300")
                    for event in ("early_ship_failed", "early_upload_failed")
                ),
                30,
                "early shipping failing on the full state dir",
                details=log,
            )
            filler.unlink()
            _complete(ckpt, 300)
            _committed(daemon, 300, timeout=60)

            # SIGTERM while a checkpoint is on its way.
            ckpt = _save_early(root, 400, model_bytes=24 * MiB)
            wait_until(
                lambda: daemon.events_named("early_upload_started", checkpoint="checkpoint-400"),
                30,
                "checkpoint-400 on its way",
                details=log,
            )
            # Said and counted, each time.
            assert daemon.metric("ckptd_task_failures_total", task="early") >= 2
            assert daemon.stop(timeout=60) == 0
    _assert_nothing_unhandled(daemon)
    # Everything the journal holds was shipped once the fault passed (at the stop).
    lines = (goodput / f"{RUN}.jsonl").read_text().splitlines()
    assert int((goodput / f"{RUN}.shipped").read_text()) == len(lines)


def test_store_killed_and_restarted_leaves_nothing_unhandled(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = LocalS3(tmp_path_factory.mktemp("seaweedfs-killed"), buckets=(BUCKET,)).start()
    root = tmp_path / "run"
    root.mkdir()
    try:
        daemon = Daemon.configured(
            tmp_path,
            watch=[{"dir": root, "run_id": RUN, "settle_seconds": 0.3}],
            dest=f"s3://{BUCKET}/killed",
            endpoint_url=store.endpoint_url,
            state_dir=tmp_path / "state",
            part_size_mib=5,
            max_attempts=3,
        )
        text = daemon.config.read_text().replace("[destination]\n", '[destination]\nname = "s3"\n')
        daemon.config.write_text(text)
        daemon.env.update({**FAULT_ENV, **store.env()})
        with daemon:
            ckpt = _save_early(root, 100)
            _complete(ckpt, 100)
            _committed(daemon, 100)

            assert store.process is not None
            store.process.kill()  # no goodbye: connections refused from here on
            store.process.wait()
            store.process = None
            ckpt = _save_early(root, 200)
            _tier_drops_within_5s(daemon, "s3", "the store killed")

            store.start()  # the same port and data
            wait_until(
                lambda: daemon.metric("ckptd_tier_up", tier="s3") == 1,
                30,
                "s3 up again",
                details=lambda: daemon.log_text()[-4000:],
            )
            _complete(ckpt, 200)
            _committed(daemon, 200, timeout=60)
            assert daemon.metric("ckptd_task_failures_total", task="early") >= 1
            assert daemon.stop(timeout=60) == 0
    finally:
        store.stop()
    _assert_nothing_unhandled(daemon)


def test_a_full_tier_and_files_deleted_or_truncated_mid_upload_leave_nothing_unhandled(
    tmp_path: Path,
) -> None:
    """A ``file://`` tier on a 20 MiB tmpfs: a checkpoint larger than it fails (ENOSPC),
    said and retried, never committed, and gone with its local copy; a file deleted
    mid-upload leaves its checkpoint uncommitted; a file truncated mid-upload commits as
    it is now, byte for byte. Nothing unhandled, exit 0."""
    root = tmp_path / "run"
    root.mkdir()
    with tmpfs(tmp_path / "small", 20) as small:
        daemon = Daemon.configured(
            tmp_path,
            watch=[{"dir": root, "run_id": RUN, "settle_seconds": 0.3}],
            dest=f"file://{small}",
            state_dir=tmp_path / "state",
            part_size_mib=5,
            max_upload_mib_per_s=8,
        )
        daemon.env.update(FAULT_ENV)
        log = lambda: daemon.log_text()[-4000:]  # noqa: E731
        with daemon:
            too_big = _save_early(root, 100, model_bytes=32 * MiB)
            _complete(too_big, 100)
            wait_until(
                lambda: daemon.events_named("checkpoint_failed", checkpoint="checkpoint-100"),
                60,
                "checkpoint-100 failing on the full tier",
                details=log,
            )
            shutil.rmtree(too_big)  # the trainer's rotation: the daemon lets it go

            deleted = _save_early(root, 200, model_bytes=6 * MiB)
            wait_until(
                lambda: daemon.events_named("early_upload_started", checkpoint="checkpoint-200"),
                30,
                "checkpoint-200 on its way",
                details=log,
            )
            (deleted / "model.safetensors").unlink()
            _complete(deleted, 200)

            truncated = _save_early(root, 300, model_bytes=6 * MiB)
            wait_until(
                lambda: daemon.events_named("early_upload_started", checkpoint="checkpoint-300"),
                30,
                "checkpoint-300 on its way",
                details=log,
            )
            with open(truncated / "model.safetensors", "r+b") as f:
                f.truncate(1000)
            _complete(truncated, 300)
            _committed(daemon, 300, timeout=90)
            assert daemon.stop(timeout=60) == 0
        committed = {
            p.parent.name
            for p in small.glob(f"{RUN}/*/ckptd.manifest.json")
            if json.loads(p.read_bytes()).get("format") == "ckptd.manifest/1"
        }
        assert "checkpoint-100" not in committed
        # 200 commits only as what its files are now (no model), never with the old one.
        if "checkpoint-200" in committed:
            assert not (small / RUN / "checkpoint-200" / "model.safetensors").exists()
        assert "checkpoint-300" in committed
        for path in ("model.safetensors", "config.json", "trainer_state.json"):
            stored = (small / RUN / "checkpoint-300" / path).read_bytes()
            assert stored == (truncated / path).read_bytes(), path
    _assert_nothing_unhandled(daemon)
