"""End-to-end: the daemon as a real process against a real SeaweedFS on loopback."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c as independent_crc  # a second CRC-32C implementation, not the one ckptd uses
import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, committed_manifest, run_cli, wait_until
from tests.support.faultproxy import FaultProxy
from tests.support.writers import (
    dcp_steps,
    hf_steps,
    local_files,
    write_bytes,
    write_dcp,
    write_deepspeed,
    write_hf,
)

MiB = 1024 * 1024


def _object(s3: Any, key: str) -> bytes:
    return bytes(s3.get_object(Bucket="ckpt", Key=key)["Body"].read())


def _keys(s3: Any, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="ckpt", Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _assert_committed_identical(s3: Any, prefix: str, run: str, local_dir: Path) -> dict[str, Any]:
    """The remote checkpoint holds exactly the local files, and the manifest's sizes and
    CRC-32C values match the bytes read back from the store."""
    manifest = committed_manifest(s3, prefix, run, local_dir.name)
    assert manifest is not None, f"{run}/{local_dir.name} not committed"
    local = local_files(local_dir)
    assert {f["path"] for f in manifest["files"]} == set(local)
    for entry in manifest["files"]:
        remote = _object(s3, f"{prefix}/{run}/{local_dir.name}/{entry['path']}")
        assert remote == local[entry["path"]], entry["path"]
        assert entry["size"] == len(remote)
        assert entry["crc32c"] == f"{independent_crc.crc32c(remote):08x}"
    assert manifest["total_bytes"] == sum(len(b) for b in local.values())
    return manifest


def _daemon(
    tmp_path: Path, local_s3: LocalS3, dest: str, watch: list[dict[str, Any]], **kw: Any
) -> Daemon:
    endpoint = kw.pop("endpoint_url", local_s3.endpoint_url)
    name = kw.pop("name", "daemon")
    return Daemon.configured(
        tmp_path,
        name=name,
        watch=watch,
        dest=dest,
        endpoint_url=endpoint,
        state_dir=tmp_path / "state",
        **kw,
    )


def test_hf_dcp_deepspeed_checkpoints_commit_byte_identical(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    roots = {run: tmp_path / run for run in ("hf", "dcp", "ds")}
    for root in roots.values():
        root.mkdir()
    watch = [{"dir": root, "settle_seconds": 0.2} for root in roots.values()]
    with _daemon(tmp_path, local_s3, s3_dest, watch, part_size_mib=5) as daemon:
        written = [
            ("hf", write_hf(roots["hf"], 10, model_bytes=12 * MiB)),  # multipart: 3 parts
            ("dcp", write_dcp(roots["dcp"], 10)),
            ("ds", write_deepspeed(roots["ds"], 10)),
        ]
        for run, local_dir in written:
            wait_until(
                lambda r=run, d=local_dir: committed_manifest(s3_client, s3_prefix, r, d.name),
                30,
                f"{run} commit",
            )
        for run, local_dir in written:
            manifest = _assert_committed_identical(s3_client, s3_prefix, run, local_dir)
            assert manifest["step"] == 10
            assert manifest["layout"] == {"hf": "hf", "dcp": "dcp", "ds": "deepspeed"}[run]
            latest = _object(s3_client, f"{s3_prefix}/{run}/LATEST")
            assert local_dir.name.encode() in latest
        assert daemon.metric("ckptd_checkpoints_committed_total", run="hf") == 1
        assert daemon.metric("ckptd_last_committed_step", run="ds") == 10
        # The DeepSpeed tracker and dot-entries are never taken for checkpoints.
        assert not any("/ds/latest/" in k for k in _keys(s3_client, s3_prefix))


def test_checkpoint_is_not_committed_until_its_completion_rule_holds(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    hf_root, dcp_root = tmp_path / "hf", tmp_path / "dcp"
    hf_root.mkdir()
    dcp_root.mkdir()
    watch = [{"dir": hf_root, "settle_seconds": 0.2}, {"dir": dcp_root}]
    with _daemon(tmp_path, local_s3, s3_dest, watch) as daemon:
        hf = hf_steps(hf_root, 5)
        dcp = dcp_steps(dcp_root, 5)
        next(hf), next(hf)  # model and optimizer written, no trainer_state.json yet
        next(dcp), next(dcp)  # shards and .metadata.tmp, not yet renamed
        for run, name in (("hf", "checkpoint-5"), ("dcp", "step-5")):
            wait_until(
                lambda r=run, n=name: daemon.events_named(
                    "checkpoint_detected", run=r, checkpoint=n
                ),
                20,
                "seen",
            )
        # Let a full evaluation round pass after the last write: the settle window and a
        # debounced re-check, observed through the daemon's own status, not a sleep.
        wait_until(
            lambda: daemon.get_json("/v1/status")["runs"]["hf"]["pending"] == [], 5, "status"
        )
        assert committed_manifest(s3_client, s3_prefix, "hf", "checkpoint-5") is None
        assert committed_manifest(s3_client, s3_prefix, "dcp", "step-5") is None
        assert not daemon.events_named("checkpoint_complete")
        next(hf)  # trainer_state.json: HF's last write
        next(dcp)  # rename .metadata.tmp -> .metadata: DCP's commit
        wait_until(
            lambda: committed_manifest(s3_client, s3_prefix, "hf", "checkpoint-5"), 30, "hf commit"
        )
        wait_until(
            lambda: committed_manifest(s3_client, s3_prefix, "dcp", "step-5"), 30, "dcp commit"
        )
        dcp_manifest = _assert_committed_identical(s3_client, s3_prefix, "dcp", dcp_root / "step-5")
        assert ".metadata" in {f["path"] for f in dcp_manifest["files"]}
        assert ".metadata.tmp" not in {f["path"] for f in dcp_manifest["files"]}


def _journal_parts(state_dir: Path) -> int:
    with sqlite3.connect(state_dir / "journal.sqlite3") as db:
        return int(db.execute("SELECT COUNT(*) FROM parts").fetchone()[0])


def test_kill_9_mid_multipart_resumes_without_resending_finished_parts(
    tmp_path: Path,
    local_s3: LocalS3,
    fault_proxy: FaultProxy,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    size = 60 * MiB
    ckpt = root / "checkpoint-7"
    write_bytes(ckpt / "model.safetensors", size)
    (ckpt / "trainer_state.json").write_text('{"global_step": 7}')
    watch = [{"dir": root, "settle_seconds": 0}]
    # Throttled so the kill lands mid-upload; concurrency 2 keeps in-flight parts few.
    first = _daemon(
        tmp_path,
        local_s3,
        s3_dest,
        watch,
        endpoint_url=fault_proxy.url,
        part_size_mib=5,
        concurrency=2,
        max_upload_mib_per_s=10,
        name="first",
    )
    with first:
        wait_until(lambda: _journal_parts(tmp_path / "state") >= 4, 60, "4 parts journalled")
        first.kill9()
    parts_done = _journal_parts(tmp_path / "state")
    sent_before = fault_proxy.bytes_up
    assert parts_done * 5 * MiB < size, "the upload finished before the kill; nothing to prove"
    assert committed_manifest(s3_client, s3_prefix, "run", "checkpoint-7") is None

    second = _daemon(
        tmp_path,
        local_s3,
        s3_dest,
        watch,
        endpoint_url=fault_proxy.url,
        part_size_mib=5,
        concurrency=2,
        name="second",
    )
    with second:
        wait_until(
            lambda: committed_manifest(s3_client, s3_prefix, "run", "checkpoint-7"),
            60,
            "commit after restart",
        )
        committed = wait_until(
            lambda: second.events_named("checkpoint_committed", checkpoint="checkpoint-7"),
            10,
            "log",
        )
    resent = fault_proxy.bytes_up - sent_before
    # Only the parts not journalled as finished (plus small control objects) went again.
    assert resent <= size - parts_done * 5 * MiB + 64 * 1024, (resent, parts_done)
    assert committed and committed[0]["resumed"] == 1
    # What shipping it cost the node: some CPU (parts were read, checksummed, sent), and
    # no more than every core busy for the upload's whole wall time could give.
    cores = os.cpu_count() or 1
    assert 0 < committed[0]["cpu_seconds"] <= committed[0]["seconds"] * cores + 0.01
    _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)
    uploads = s3_client.list_multipart_uploads(Bucket="ckpt", Prefix=s3_prefix).get("Uploads", [])
    assert uploads == [], "an orphaned multipart upload was left behind"


def test_checkpoint_deleted_mid_upload_is_never_committed_and_the_next_one_is(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    # The ordinary transfer of a complete checkpoint is what these two tests cut into.
    # With early shipping on, a loaded machine could let the first files go before the
    # rule held, and the deletion then takes early shipping's path instead
    # (tests/process/test_early_ship.py covers that one).
    watch = [{"dir": root, "settle_seconds": 0, "ship_early": False}]
    with _daemon(
        tmp_path, local_s3, s3_dest, watch, part_size_mib=5, concurrency=2, max_upload_mib_per_s=8
    ) as daemon:
        doomed = write_hf(root, 1, model_bytes=40 * MiB)
        wait_until(
            lambda: daemon.metric("ckptd_upload_bytes_total", run="run") > 0, 30, "upload started"
        )
        shutil.rmtree(doomed)  # what HF's save_total_limit rotation does
        survivor = write_hf(root, 2, model_bytes=2 * MiB)
        wait_until(
            lambda: committed_manifest(s3_client, s3_prefix, "run", "checkpoint-2"),
            60,
            "next checkpoint",
        )

        # Polled: the doomed one may be noticed after the survivor commits (its parts go
        # at 8 MiB/s, and the transfer sees the deletion at its next part).
        wait_until(
            lambda: daemon.events_named("checkpoint_abandoned", checkpoint="checkpoint-1"),
            60,
            "checkpoint-1 abandoned",
        )
        assert daemon.metric("ckptd_checkpoints_abandoned_total", run="run") == 1
        assert daemon.alive()
    assert committed_manifest(s3_client, s3_prefix, "run", "checkpoint-1") is None
    # Nothing of it is left but, if retention got to the emptied slot first, the
    # withdrawal it writes before collecting one (docs/design.md "Deleting beside a writer:
    # withdrawals").
    left = _keys(s3_client, f"{s3_prefix}/run/checkpoint-1/")
    marker = f"{s3_prefix}/run/checkpoint-1/ckptd.manifest.json"
    assert left in ([], [marker]), left
    if left:
        doc = json.loads(s3_client.get_object(Bucket="ckpt", Key=marker)["Body"].read())
        assert doc["format"] == "ckptd.withdrawn/1"
    assert (
        s3_client.list_multipart_uploads(Bucket="ckpt", Prefix=s3_prefix).get("Uploads", []) == []
    )
    _assert_committed_identical(s3_client, s3_prefix, "run", survivor)


def test_checkpoint_rewritten_mid_upload_is_never_committed_mixed(
    tmp_path: Path, local_s3: LocalS3, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    watch = [{"dir": root, "settle_seconds": 0, "ship_early": False}]  # as above
    with _daemon(
        tmp_path, local_s3, s3_dest, watch, part_size_mib=5, concurrency=2, max_upload_mib_per_s=8
    ) as daemon:
        ckpt = write_hf(root, 3, model_bytes=30 * MiB)
        wait_until(
            lambda: daemon.metric("ckptd_upload_bytes_total", run="run") > 0, 30, "upload started"
        )
        # The trainer saves the same step again (a restart that re-reached it).
        shutil.rmtree(ckpt)
        write_hf(root, 3, model_bytes=3 * MiB)
        wait_until(
            lambda: committed_manifest(s3_client, s3_prefix, "run", "checkpoint-3"),
            60,
            "commit of the rewrite",
        )
        assert daemon.events_named("checkpoint_abandoned", checkpoint="checkpoint-3")
    # What is committed is exactly the second version, never a mix.
    _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)


def test_transient_s3_errors_are_retried_to_success(
    tmp_path: Path,
    local_s3: LocalS3,
    fault_proxy: FaultProxy,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    fault_proxy.set_faults(rate=0.3, kinds=("500", "503-slowdown", "reset"), seed=7)
    watch = [{"dir": root, "settle_seconds": 0}]
    with _daemon(
        tmp_path,
        local_s3,
        s3_dest,
        watch,
        endpoint_url=fault_proxy.url,
        part_size_mib=5,
        max_attempts=20,
    ) as daemon:
        dirs = [write_hf(root, step, model_bytes=11 * MiB) for step in (1, 2)]
        for d in dirs:
            wait_until(
                lambda d=d: committed_manifest(s3_client, s3_prefix, "run", d.name),
                90,
                f"commit {d.name}",
            )
        retries = sum(
            v for (name, _), v in daemon.metrics().items() if name == "ckptd_retries_total"
        )
        assert fault_proxy.faults_injected > 0
        assert retries > 0
        assert daemon.events_named("storage_retry")
    for d in dirs:
        _assert_committed_identical(s3_client, s3_prefix, "run", d)


def test_a_lost_answer_to_create_multipart_upload_leaves_no_orphaned_upload(
    tmp_path: Path,
    local_s3: LocalS3,
    fault_proxy: FaultProxy,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
) -> None:
    # Found by the proxy-fault campaign (tests/campaigns/faults.py): the store created the
    # upload, the answer was lost, the retry created a second one; the first was left.
    root = tmp_path / "run"
    root.mkdir()
    # The first POST is the first file's CreateMultipartUpload (the only other POSTs
    # complete an upload, after it).
    fault_proxy.fail_next(1, "reset-after-upstream", methods={"POST"})
    watch = [{"dir": root, "settle_seconds": 0}]
    with _daemon(
        tmp_path, local_s3, s3_dest, watch, endpoint_url=fault_proxy.url, part_size_mib=5
    ) as daemon:
        ckpt = write_hf(root, 1, model_bytes=11 * MiB)
        wait_until(
            lambda: committed_manifest(s3_client, s3_prefix, "run", "checkpoint-1"), 60, "commit"
        )
        assert fault_proxy.faults_injected == 1
        assert daemon.events_named("lost_uploads_aborted")
    _assert_committed_identical(s3_client, s3_prefix, "run", ckpt)
    uploads = s3_client.list_multipart_uploads(Bucket="ckpt", Prefix=s3_prefix).get("Uploads", [])
    assert uploads == [], "an orphaned multipart upload was left behind"


def test_missing_bucket_is_a_clear_error_in_logs_and_metrics_not_a_crash_loop(
    tmp_path: Path, local_s3: LocalS3
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    watch = [{"dir": root, "settle_seconds": 0}]
    with _daemon(tmp_path, local_s3, "s3://no-such-bucket-ckptd/x", watch) as daemon:
        write_hf(root, 1, model_bytes=1024)
        wait_until(lambda: daemon.events_named("checkpoint_failed"), 30, "failure logged")
        unusable = daemon.events_named("destination_unusable")
        assert unusable and "NoSuchBucket" in unusable[0]["code"] + unusable[0]["error"]
        failed = daemon.events_named("checkpoint_failed")
        assert failed[0]["code"] == "NoSuchBucket"
        assert daemon.metric("ckptd_destination_up") == 0
        assert daemon.metric("ckptd_checkpoints_failed_total", run="run", reason="unusable") >= 1
        ready = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import urllib.request as u; u.urlopen('http://127.0.0.1:{daemon.port}/readyz')",
            ],
            capture_output=True,
        )
        assert ready.returncode != 0  # 503: not ready while the destination is unusable
        # Backed off, still serving: the failure is retried slowly, not in a hot loop.
        wait_until(lambda: daemon.get_json("/healthz")["ok"], 5, "healthz")
        assert len(daemon.events_named("checkpoint_failed")) <= 3
        assert daemon.alive()
        assert daemon.stop() == 0


def test_unchanged_file_is_copied_server_side_not_uploaded(
    tmp_path: Path,
    local_s3: LocalS3,
    fault_proxy: FaultProxy,
    s3_client: Any,
    s3_prefix: str,
    s3_dest: str,
) -> None:
    root = tmp_path / "lora"
    base = write_bytes(tmp_path / "base.bin", 24 * MiB)  # a frozen base model
    watch = [{"dir": root, "marker": "COMPLETE", "layout": "marker"}]
    root.mkdir()

    def save(step: int) -> Path:
        d = root / f"step-{step}"
        (d).mkdir()
        (d / "base_model.bin").write_bytes(base)
        write_bytes(d / "adapter.safetensors", 2 * MiB)
        (d / "COMPLETE").write_text("")
        return d

    with _daemon(
        tmp_path, local_s3, s3_dest, watch, endpoint_url=fault_proxy.url, part_size_mib=8
    ) as daemon:
        first = save(100)
        wait_until(
            lambda: committed_manifest(s3_client, s3_prefix, "lora", first.name), 30, "first commit"
        )
        fault_proxy.reset_counters()
        second = save(200)
        wait_until(
            lambda: committed_manifest(s3_client, s3_prefix, "lora", second.name),
            30,
            "second commit",
        )
        sent = fault_proxy.bytes_up
        assert daemon.metric("ckptd_copied_bytes_total", run="lora") == len(base)
    assert sent < 3 * MiB, f"{sent} bytes sent: the unchanged base model was uploaded again"
    manifest = _assert_committed_identical(s3_client, s3_prefix, "lora", second)
    crcs = {f["path"]: f["crc32c"] for f in manifest["files"]}
    assert crcs["base_model.bin"] == f"{independent_crc.crc32c(base):08x}"


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[destination]\nurl = "s3://b/p"\npart_size_mib = 1\n', "destination.part_size_mib"),
        ('[destination]\nurl = "ftp://x"\n', "destination.url"),
        ('[destination]\nurl = "s3://b/p"\nbogus = 1\n', "destination.bogus"),
        ('[metrics]\nlisten = "nonsense"\n', "metrics.listen"),
        ('[[watch]]\ndir = "relative/dir"\n', "watch[0].dir"),
        ('[trainer]\nsignal = "SIGNOPE"\n', "trainer.signal"),
        ('[preemption]\nprovider = "oracle"\n', "preemption.provider"),
        ("[nonsense]\n", "nonsense"),
    ],
)
def test_invalid_config_exits_2_naming_the_key(tmp_path: Path, toml: str, key: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    for command in (["config", "check"], ["run"]):
        result = run_cli(*command, config=cfg, timeout=60)
        assert result.returncode == 2, (command, result.stderr)
        assert key in result.stderr, (command, result.stderr)


def test_file_destination_commits_with_fsynced_renames(tmp_path: Path) -> None:
    root, shared = tmp_path / "run", tmp_path / "shared"
    root.mkdir()
    ckpt = write_hf(root, 4, model_bytes=7 * MiB)

    def run_once(config: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "ckptd",
                "run",
                "--once",
                "--watch",
                str(root),
                "--dest",
                f"file://{shared}",
                "--state-dir",
                str(tmp_path / "state"),
                "--config",
                str(config),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    # An explicitly named config that does not exist is an error naming it.
    result = run_once(tmp_path / "none.toml")
    assert result.returncode == 2 and "none.toml" in result.stderr
    (tmp_path / "empty.toml").write_text("[destination]\npart_size_mib = 5\n")
    result = run_once(tmp_path / "empty.toml")
    assert result.returncode == 0, result.stderr
    remote = shared / "run" / "checkpoint-4"
    assert local_files(ckpt) == {
        k: v
        for k, v in local_files(remote).items()
        if k not in ("ckptd.manifest.json", "ckptd.claim.json")
    }
    assert (shared / "run" / "LATEST").exists()
    assert not [p for p in shared.rglob("*") if ".ckptd-" in p.name], "temporary files left behind"
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptd",
            "list",
            "--dest",
            f"file://{shared}",
            "--json",
            "--config",
            str(tmp_path / "empty.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    import json

    rows = json.loads(listed.stdout)["checkpoints"]
    assert [(r["run"], r["checkpoint"], r["step"], r["latest"]) for r in rows] == [
        ("run", "checkpoint-4", 4, True)
    ]


def test_a_linked_file_is_committed_with_its_bytes_and_a_dangling_link_is_refused(
    tmp_path: Path,
) -> None:
    """Symlinks inside a checkpoint: a link to a file ships that file's bytes (a restore
    has them); a dangling one keeps the checkpoint from committing, logged by name, and
    `run --once` exits 1 for it."""
    run, store = tmp_path / "run", tmp_path / "store"
    shared = tmp_path / "shared.bin"
    shared.write_bytes(os.urandom(300_000))
    good = write_hf(run, 4, model_bytes=MiB)
    (good / "shared.bin").symlink_to(shared)
    bad = write_hf(run, 8, model_bytes=MiB)
    (bad / "tokenizer.json").symlink_to(tmp_path / "deleted-before-the-save-ended")
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(
        f'[[watch]]\ndir = "{run}"\nrun_id = "run"\nsettle_seconds = 0\n'
        f'[destination]\nurl = "file://{store}"\n[state]\ndir = "{tmp_path / "state"}"\n'
    )
    done = run_cli("run", "--once", config=cfg, timeout=120)
    # README: "1 if --once failed": checkpoint-8 is there and was not shipped.
    assert done.returncode == 1, done.stderr
    assert "checkpoint_has_unshippable_entries" in done.stderr
    assert "tokenizer.json" in done.stderr
    (not_shipped,) = [
        json.loads(line)
        for line in done.stderr.splitlines()
        if line.startswith("{") and '"checkpoints_not_shipped"' in line
    ]
    assert not_shipped["checkpoints"] == ["run/checkpoint-8"]
    assert "tokenizer.json" in not_shipped["why"]["run/checkpoint-8"]  # what it cannot ship
    # It can never commit as it is: none of its files was sent ahead either.
    assert not [
        line
        for line in done.stderr.splitlines()
        if ('"early_upload_started"' in line or '"early_batch_started"' in line)
        and '"checkpoint-8"' in line
    ]
    listed = run_cli("list", "--json", config=cfg)
    names = [c["checkpoint"] for c in json.loads(listed.stdout)["checkpoints"]]
    assert names == ["checkpoint-4"]
    restored = run_cli(
        "restore",
        "--run",
        "run",
        "--checkpoint",
        "checkpoint-4",
        "--to",
        str(tmp_path / "r"),
        config=cfg,
    )
    assert restored.returncode == 0, restored.stderr
    copy = tmp_path / "r" / "checkpoint-4" / "shared.bin"
    assert not copy.is_symlink() and copy.read_bytes() == shared.read_bytes()


def test_a_restarted_daemon_shows_the_last_commit_before_shipping_anything(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """What the store holds as committed is read at start-up: /v1/status, `ckptd status`
    and ckptd_last_committed_step show checkpoint-100 before anything new ships."""
    run = tmp_path / "run"
    write_hf(run, 100, model_bytes=64 * 1024)
    watch = [{"dir": run, "settle_seconds": 0}]
    daemon = _daemon(tmp_path, local_s3, s3_dest, watch)
    once = run_cli("run", "--once", config=daemon.config, timeout=120)
    assert once.returncode == 0, once.stderr
    with daemon:
        status = daemon.get_json("/v1/status")["runs"]["run"]
        assert status["last_committed"] is not None, status
        assert (status["last_committed"]["checkpoint"], status["last_committed"]["step"]) == (
            "checkpoint-100",
            100,
        )
        assert daemon.metric("ckptd_last_committed_step", run="run") == 100
        assert daemon.metric("ckptd_last_commit_timestamp_seconds", run="run") > 0
        # Nothing was committed by this process: the counter says so.
        assert daemon.metric("ckptd_checkpoints_committed_total", run="run") == 0
        shown = run_cli("status", "--json", config=daemon.config, timeout=60)
        assert shown.returncode == 0, shown.stderr
        runs = json.loads(shown.stdout)["runs"]
        assert runs["run"]["last_committed"]["checkpoint"] == "checkpoint-100"
        table = run_cli("status", config=daemon.config, timeout=60)
        assert "checkpoint-100" in table.stdout, table.stdout
        assert not daemon.events_named("checkpoint_committed")


def test_a_notice_file_left_by_an_earlier_daemon_is_removed_at_start(tmp_path: Path) -> None:
    """After a restart no notice is in force until a source delivers one again, so the
    previous daemon's .ckptd/preemption.json (which trainers act on) must not stay."""
    run = tmp_path / "run"
    stale = run / ".ckptd" / "preemption.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(
        json.dumps(
            {
                "source": "sigterm",
                "kind": "sigterm",
                "deadline": "2026-12-03T00:01:00Z",
                "noticed_at": "2026-12-03T00:00:00Z",
                "cancelled": False,
            }
        )
    )
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(
        f'[[watch]]\ndir = "{run}"\nrun_id = "run"\n'
        f'[destination]\nurl = "file://{tmp_path / "store"}"\n[state]\ndir = "{tmp_path / "s"}"\n'
    )
    done = run_cli("run", "--once", config=cfg, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not stale.exists()
    assert "stale_notice_file_removed" in done.stderr
