"""Several destinations (tiers), end to end with real parts: a directory (``file://``)
and SeaweedFS, or two SeaweedFS buckets; the daemon and the CLI as real processes.

What it proves: every tier commits on its own; a tier that is down (every request to it
refused, through the fault proxy) holds no other back, shows in metrics and status, and
catches up when it returns; local retention deletes only what every tier committed;
retention is per tier; ``list`` shows who holds what; ``restore --latest`` takes the
newest step from the first tier holding it, and skips a tier whose copy was tampered
with, leaving nothing corrupt under the target.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3, free_port
from tests.conftest import BUCKET
from tests.support.daemon import Daemon, committed_manifest, run_cli, wait_until
from tests.support.faultproxy import FaultProxy

RUN = "run"
SECOND_BUCKET = "ckpt-tier2"


def save(watch: Path, step: int) -> dict[str, bytes]:
    """A checkpoint as a marker-layout trainer writes it; returns its files' bytes."""
    root = watch / f"checkpoint-{step}"
    files = {"model.bin": os.urandom(300_000), "optim/state.bin": os.urandom(70_000)}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "COMPLETE").write_bytes(b"")
    return files


def write_tier_config(
    path: Path,
    *,
    watch: Path,
    state: Path,
    port: int,
    first: dict[str, Any],
    retention: dict[str, Any],
    tiers: list[dict[str, Any]],
) -> Path:
    def table(values: dict[str, Any]) -> list[str]:
        return [f"{k} = {json.dumps(v)}" for k, v in values.items() if k != "retention"]

    lines = [
        "[[watch]]",
        f"dir = {json.dumps(str(watch))}",
        f'run_id = "{RUN}"',
        'layout = "marker"',
        "rescan_seconds = 1",
        "[destination]",
        *table(first),
        "[retention]",
        *table(retention),
    ]
    for tier in tiers:
        lines += ["[[tiers]]", *table(tier), "[tiers.retention]", *table(tier["retention"])]
    lines += ["[preemption]", 'provider = "none"', "[metrics]", f'listen = "127.0.0.1:{port}"']
    lines += ["[state]", f"dir = {json.dumps(str(state))}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def in_dir(root: Path, step: int) -> bool:
    return (root / RUN / f"checkpoint-{step}" / "ckptd.manifest.json").is_file()


def test_a_tier_that_is_down_holds_no_other_back_and_catches_up(
    local_s3: LocalS3, s3_client: Any, s3_prefix: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    watch, nfs = tmp_path / "watch", tmp_path / "nfs"
    watch.mkdir()
    port = free_port()
    config = write_tier_config(
        tmp_path / "ckptd.toml",
        watch=watch,
        state=tmp_path / "state",
        port=port,
        first={"url": f"file://{nfs}", "name": "nfs"},
        retention={"keep_last": 2, "local_keep_last": 1},
        tiers=[
            {
                "name": "s3",
                "url": f"s3://{BUCKET}/{s3_prefix}",
                "endpoint_url": fault_proxy.url,
                "max_attempts": 2,
                "retention": {"keep_last": 0, "keep_within": "1h"},
            }
        ],
    )
    daemon = Daemon(config, tmp_path / "daemon.log", port)

    def in_s3(step: int) -> bool:
        return committed_manifest(s3_client, s3_prefix, RUN, f"checkpoint-{step}") is not None

    with daemon:
        log = daemon.log_text
        save(watch, 100)
        wait_until(lambda: in_dir(nfs, 100) and in_s3(100), 30, "both tiers commit", details=log)
        # The manifest is in the store a moment before the daemon counts it.
        wait_until(
            lambda: all(
                daemon.metric("ckptd_tier_checkpoints_committed_total", run=RUN, tier=t) == 1
                for t in ("nfs", "s3")
            ),
            10,
            "each tier counted once",
        )

        # The object store goes down: every request refused.
        fault_proxy.deny("503-unavailable")
        save(watch, 200)
        wait_until(lambda: in_dir(nfs, 200), 30, "nfs commits while s3 is down", details=log)
        save(watch, 300)
        wait_until(lambda: in_dir(nfs, 300), 30, "nfs commits again", details=log)
        wait_until(
            lambda: (
                daemon.metric("ckptd_tier_up", tier="s3") == 0
                and daemon.metric("ckptd_tier_pending_checkpoints", run=RUN, tier="s3") == 2
            ),
            30,
            "s3 shown down with a backlog of two",
            details=log,
        )
        status = daemon.get_json("/v1/status")
        assert status["tiers"]["s3"]["destination"]["ok"] is False
        assert status["tiers"]["s3"]["runs"][RUN]["pending"] == ["checkpoint-200", "checkpoint-300"]
        assert status["tiers"]["nfs"]["runs"][RUN]["last_committed"]["step"] == 300
        assert status["runs"][RUN]["last_committed"]["step"] == 300  # the old keys: first tier
        assert not in_s3(200) and not in_s3(300)
        # Local retention (keep 1) deleted checkpoint-100, in both tiers, but keeps 200:
        # the object store does not hold it yet.
        wait_until(lambda: not (watch / "checkpoint-100").exists(), 30, "local 100 deleted")
        assert (watch / "checkpoint-200" / "COMPLETE").exists()

        # Back: the backlog is shipped, oldest first, without a restart.
        fault_proxy.clear_faults()
        back = time.monotonic()
        wait_until(lambda: in_s3(200) and in_s3(300), 60, "s3 catches up", details=log)
        print(f"s3 tier caught up {time.monotonic() - back:.1f} s after it came back")
        wait_until(
            lambda: (
                daemon.metric("ckptd_tier_pending_checkpoints", run=RUN, tier="s3") == 0
                and daemon.metric("ckptd_tier_up", tier="s3") == 1
            ),
            30,
            "s3 backlog gone",
        )
        wait_until(lambda: not (watch / "checkpoint-200").exists(), 30, "local 200 deleted now")
        assert (watch / "checkpoint-300").exists()  # the newest stays
        assert daemon.metric("ckptd_tier_checkpoints_committed_total", run=RUN, tier="s3") == 3
        assert daemon.metric("ckptd_tier_last_committed_step", run=RUN, tier="s3") == 300
        assert daemon.metric("ckptd_tier_checkpoints_failed_total", run=RUN, tier="s3") >= 1
        assert daemon.metric("ckptd_checkpoints_committed_total", run=RUN) == 3  # first tier
        assert daemon.stop() == 0

    # Retention per tier: nfs keeps 2, s3 keeps everything within the hour.
    assert not in_dir(nfs, 100) and in_dir(nfs, 200) and in_dir(nfs, 300)
    assert all(in_s3(step) for step in (100, 200, 300))
    listed = run_cli("list", "--json", config=config)
    assert listed.returncode == 0, listed.stderr
    holders = {c["checkpoint"]: c["tiers"] for c in json.loads(listed.stdout)["checkpoints"]}
    assert holders == {
        "checkpoint-100": ["s3"],
        "checkpoint-200": ["nfs", "s3"],
        "checkpoint-300": ["nfs", "s3"],
    }
    table = run_cli("list", config=config)
    assert table.returncode == 0, table.stderr
    assert "TIERS" in table.stdout and table.stdout.rstrip().endswith("nfs,s3")


@pytest.fixture
def second_bucket(s3_client: Any) -> str:
    try:
        s3_client.create_bucket(Bucket=SECOND_BUCKET)
    except s3_client.exceptions.BucketAlreadyOwnedByYou:
        pass
    except s3_client.exceptions.BucketAlreadyExists:
        pass
    return SECOND_BUCKET


def test_restore_takes_the_newest_step_from_the_first_tier_and_skips_a_tampered_copy(
    local_s3: LocalS3, s3_client: Any, s3_prefix: str, second_bucket: str, tmp_path: Path
) -> None:
    watch = tmp_path / "watch"
    watch.mkdir()
    slow_prefix = f"slow-{s3_prefix}"
    config = write_tier_config(
        tmp_path / "ckptd.toml",
        watch=watch,
        state=tmp_path / "state",
        port=free_port(),
        first={
            "url": f"s3://{BUCKET}/{s3_prefix}",
            "endpoint_url": local_s3.endpoint_url,
            "name": "fast",
        },
        retention={"keep_last": 0},
        tiers=[
            {
                "name": "slow",
                "url": f"s3://{second_bucket}/{slow_prefix}",
                "endpoint_url": local_s3.endpoint_url,
                "retention": {"keep_last": 0},
            }
        ],
    )
    save(watch, 100)
    files = save(watch, 200)
    once = run_cli("run", "--once", config=config)
    assert once.returncode == 0, once.stderr
    for bucket, prefix in ((BUCKET, s3_prefix), (second_bucket, slow_prefix)):
        for step in (100, 200):
            key = f"{prefix}/{RUN}/checkpoint-{step}/ckptd.manifest.json"
            s3_client.head_object(Bucket=bucket, Key=key)  # committed in both buckets

    def restore(target: Path, *extra: str) -> Any:
        return run_cli(
            "restore", "--run", RUN, "--latest", "--to", str(target), "--json", *extra,
            config=config,
        )  # fmt: skip

    def restored_bytes(target: Path) -> dict[str, bytes]:
        root = target / "checkpoint-200"
        return {rel: (root / rel).read_bytes() for rel in files}

    # Both hold step 200: the first tier serves it.
    first = restore(tmp_path / "r1")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["tier"] == "fast"
    assert restored_bytes(tmp_path / "r1") == files

    # The fast tier's copy is replaced by other bytes of the same size: verification
    # fails there, and the slow tier serves it, with one line saying so.
    model_key = f"{s3_prefix}/{RUN}/checkpoint-200/model.bin"
    s3_client.put_object(Bucket=BUCKET, Key=model_key, Body=os.urandom(300_000))
    second = restore(tmp_path / "r2")
    assert second.returncode == 0, second.stderr
    doc = json.loads(second.stdout)
    assert (doc["tier"], doc["skipped_tiers"]) == ("slow", ["fast"])
    skipped = [line for line in second.stderr.splitlines() if "restore_tier_skipped" in line]
    assert len(skipped) == 1 and '"tier": "fast"' in skipped[0], second.stderr
    assert restored_bytes(tmp_path / "r2") == files

    # Forced onto the tampered tier: refused, nothing under DIR/NAME.
    forced = restore(tmp_path / "r3", "--tier", "fast")
    assert forced.returncode == 1, forced.stderr
    assert not (tmp_path / "r3" / "checkpoint-200").exists()
    unknown = restore(tmp_path / "r4", "--tier", "nope")
    assert unknown.returncode == 2 and "--tier" in unknown.stderr, unknown.stderr

    # verify looks at every tier (or one).
    verified = run_cli("verify", "--run", RUN, "--latest", "--json", config=config)
    assert verified.returncode == 1, verified.stderr
    report = {t["tier"]: t["ok"] for t in json.loads(verified.stdout)["tiers"]}
    assert report == {"fast": False, "slow": True}
    only_slow = run_cli("verify", "--run", RUN, "--latest", "--tier", "slow", config=config)
    assert only_slow.returncode == 0, only_slow.stdout + only_slow.stderr

    # The fast tier loses step 200 (deleted the way retention deletes: manifest first):
    # the newest step is still 200, now found only in the slow tier.
    s3_client.delete_object(
        Bucket=BUCKET, Key=f"{s3_prefix}/{RUN}/checkpoint-200/ckptd.manifest.json"
    )
    third = restore(tmp_path / "r5")
    assert third.returncode == 0, third.stderr
    doc = json.loads(third.stdout)
    assert (doc["checkpoint"], doc["tier"], doc["skipped_tiers"]) == ("checkpoint-200", "slow", [])
    listed = json.loads(run_cli("list", "--json", config=config).stdout)
    holders = {c["checkpoint"]: c["tiers"] for c in listed["checkpoints"]}
    assert holders == {"checkpoint-100": ["fast", "slow"], "checkpoint-200": ["slow"]}


def test_restore_passes_over_a_tier_that_cannot_be_reached(tmp_path: Path) -> None:
    from ckptd.config import DestinationConfig
    from ckptd.storage import StorageError, open_storage
    from ckptd.store.restore import RestoreRequest
    from ckptd.store.tiers import TierStore, restore_from_tiers
    from tests.integration.test_retention_age import commit_aged

    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    dead = TierStore(
        "fast",
        open_storage(f"s3://{BUCKET}/x", endpoint_url=dead_url, max_attempts=1),
        DestinationConfig(url=f"s3://{BUCKET}/x", endpoint_url=dead_url, name="fast"),
    )
    good_url = f"file://{tmp_path / 'nfs'}"
    good = TierStore("nfs", open_storage(good_url), DestinationConfig(url=good_url, name="nfs"))
    commit_aged(good.storage, RUN, 100, 1_780_000_000.0)

    done = restore_from_tiers(
        [dead, good], RestoreRequest(RUN, None, tmp_path / "out", progress=False)
    )
    assert (done.tier, done.result.checkpoint) == ("nfs", "checkpoint-100")
    assert (tmp_path / "out" / "checkpoint-100" / "model.bin").stat().st_size == 96
    # Only unreachable tiers: the store's error, never "nothing to restore" (a fresh
    # node would train over the run's history).
    with pytest.raises(StorageError):
        restore_from_tiers([dead], RestoreRequest(RUN, None, tmp_path / "out2", progress=False))
    assert not (tmp_path / "out2" / "checkpoint-100").exists()


def test_exec_on_a_fresh_node_restores_from_the_tier_that_holds_the_run(tmp_path: Path) -> None:
    import subprocess
    import sys

    from ckptd.storage import open_storage
    from tests.integration.test_restore import commit_files

    # The fast tier is empty (a new NFS volume); the object store holds step 7.
    watch, nfs, far = tmp_path / "watch", tmp_path / "nfs", tmp_path / "far"
    data = os.urandom(50_000)
    commit_files(
        open_storage(f"file://{far}"),
        RUN,
        "step-7",
        {"weights.bin": data, "COMPLETE": b""},
        step=7,
    )
    config = write_tier_config(
        tmp_path / "ckptd.toml",
        watch=watch,
        state=tmp_path / "state",
        port=free_port(),
        first={"url": f"file://{nfs}", "name": "nfs"},
        retention={"keep_last": 0},
        tiers=[{"name": "far", "url": f"file://{far}", "retention": {"keep_last": 0}}],
    )
    script = "import json, os; json.dump(os.environ.get('CKPTD_RESUME_FROM'), open('r.json', 'w'))"
    trainer = [sys.executable, "-c", script]
    done = subprocess.run(
        [sys.executable, "-m", "ckptd", "exec", "--config", str(config), "--", *trainer],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "r.json").read_text()) == str(watch / "step-7")
    assert (watch / "step-7" / "weights.bin").read_bytes() == data
    restored = [json.loads(line) for line in done.stderr.splitlines() if "exec_restored" in line]
    assert restored and restored[0]["checkpoint"] == "step-7"


async def test_a_further_tier_starts_nothing_while_the_first_is_in_emergency(
    tmp_path: Path,
) -> None:
    import asyncio
    from datetime import UTC, datetime, timedelta

    from ckptd.config import load_settings
    from ckptd.daemon.service import Service
    from tests.support.fakes import wait_until as async_wait_until

    watch, state = tmp_path / "watch", tmp_path / "state"
    watch.mkdir()
    settings = load_settings(
        overrides={
            "watch": [{"dir": str(watch), "run_id": RUN, "layout": "marker"}],
            "destination": {"url": f"file://{tmp_path / 'nfs'}", "name": "nfs"},
            "tiers": [{"name": "far", "url": f"file://{tmp_path / 'far'}"}],
            "state": {"dir": str(state)},
        },
        environ={},
    )
    service = Service(settings)
    first, far = service.tiers
    stop = asyncio.Event()
    worker = asyncio.create_task(far.pipeline.work(stop))
    try:
        first.pipeline.emergency.enter_emergency(datetime.now(UTC) + timedelta(seconds=60))
        save(watch, 100)
        await far.pipeline.evaluate(RUN, "checkpoint-100")
        assert far.pipeline.queue.get(RUN, "checkpoint-100") is not None
        # A bounded look for something that must not happen: nothing starts in 1 s.
        await asyncio.sleep(1.0)
        assert far.pipeline.runs[RUN].current is None and not in_dir(tmp_path / "far", 100)
        first.pipeline.emergency.leave_emergency()
        far.pipeline.retry_now()  # what a wake-up does; the worker also looks every 0.2 s
        await async_wait_until(
            lambda: in_dir(tmp_path / "far", 100), timeout=30, what="far commits after"
        )
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
        for t in service.tiers:
            await t.pipeline.close()
            t.journal.close()
    # Local retention's view: committed in every tier, only once both hold it.
    assert service.tiers.committed_in_every_tier(RUN) == set()  # the first tier never shipped it
    far_state = far.pipeline.runs[RUN]
    assert far_state.committed == {"checkpoint-100"}


def test_once_commits_to_the_tiers_it_can_and_exits_1_for_one_that_refuses(
    local_s3: LocalS3, tmp_path: Path
) -> None:
    watch, nfs = tmp_path / "watch", tmp_path / "nfs"
    watch.mkdir()
    config = write_tier_config(
        tmp_path / "ckptd.toml",
        watch=watch,
        state=tmp_path / "state",
        port=free_port(),
        first={"url": f"file://{nfs}", "name": "nfs"},
        retention={"keep_last": 0},
        tiers=[
            {
                "name": "gone",
                "url": "s3://no-such-bucket-here/p",
                "endpoint_url": local_s3.endpoint_url,
                "max_attempts": 1,
                "retention": {},
            }
        ],
    )
    save(watch, 100)
    started = time.monotonic()
    once = run_cli("run", "--once", config=config)
    took = time.monotonic() - started
    assert once.returncode == 1, once.stderr
    assert in_dir(nfs, 100)  # the first tier was not held back
    assert '"event": "tiers_not_committed"' in once.stderr and '"gone"' in once.stderr
    assert took < 60, f"--once waited {took:.0f} s on a tier that refuses it"


def test_a_directory_tier_first_and_gs_and_az_tiers_behind_it_commit_and_restore(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Any mix of stores: an NFS-like directory first, gs:// (fake-gcs-server) and az://
    (Azurite) behind it. ``run --once`` commits to all three; each cloud tier restores
    the newest checkpoint byte-identical when asked for by name."""
    import uuid

    fake_gcs = request.getfixturevalue("fake_gcs")
    azurite = request.getfixturevalue("azurite")
    watch = tmp_path / "watch"
    watch.mkdir()
    prefix = f"mix-{uuid.uuid4().hex[:8]}"
    nfs = tmp_path / "nfs"
    config = write_tier_config(
        tmp_path / "ckptd.toml",
        watch=watch,
        state=tmp_path / "state",
        port=free_port(),
        first={"url": f"file://{nfs}", "name": "nfs"},
        retention={"keep_last": 0},
        tiers=[
            {
                "name": "gcs",
                "url": f"gs://ckpt/{prefix}",
                "endpoint_url": fake_gcs.endpoint_url,
                "retention": {"keep_last": 0},
            },
            {
                "name": "azure",
                "url": f"az://ckpt/{prefix}",
                "endpoint_url": azurite.endpoint_url,
                "retention": {"keep_last": 0},
            },
        ],
    )
    save(watch, 100)
    files = save(watch, 200)
    once = run_cli("run", "--once", config=config)
    assert once.returncode == 0, once.stderr
    assert in_dir(nfs, 100) and in_dir(nfs, 200)
    for tier in ("gcs", "azure"):
        target = tmp_path / f"restored-{tier}"
        done = run_cli(
            "restore", "--run", RUN, "--latest", "--tier", tier, "--to", str(target), "--json",
            config=config,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["tier"] == tier
        root = target / "checkpoint-200"
        assert {rel: (root / rel).read_bytes() for rel in files} == files
