"""Checkpoints of thousands of small files (DCP shards, zarr chunks), end to end, counted on
the wire by the fault proxy: one request per file each way, as docs/design.md ("Requests
per checkpoint") says, and every byte back as written.

The benchmark (bench/bench_manyfiles.py) times the same against the AWS CLI and s5cmd,
and takes 100,000 files; here the sizes are kept to what CI affords.
"""

from __future__ import annotations

import collections
import os
import random
import time
from pathlib import Path
from typing import Any

import crc32c as independent_crc  # a second CRC-32C implementation, not the one ckptd uses

from tests.support.daemon import Daemon, committed_manifest, run_cli, wait_until
from tests.support.faultproxy import FaultProxy, RequestRecord
from tests.support.writers import local_files

# What docs/design.md's "Requests per checkpoint" allows besides one request per file: the
# commit protocol's five (step 0: the GET of the canonical manifest key and the claim's
# create-only PUT; the manifest's PUT; LATEST's GET and PUT), `run --once`'s start (the
# bucket check, the run's LATEST) and the retention pass after the commit (LATEST, two
# listings, the new manifest's GET and HEAD). None grows with the number of files.
PER_CHECKPOINT_UP = 12
# A restore: LATEST, the manifest, one listing per 1,000 objects (3 here), the lease's
# PUT and its delete.
PER_CHECKPOINT_DOWN = 7


def _write_shards(ckpt: Path, count: int, seed: int, *, metadata: bool = True) -> dict[str, bytes]:
    """A DCP-shaped checkpoint of ``count`` small shards (1-4 KiB), a few in
    subdirectories, and (``metadata``) ``.metadata`` written last."""
    rng = random.Random(seed)
    ckpt.mkdir(parents=True)
    written: dict[str, bytes] = {}
    for i in range(count):
        rel = f"__{i}_0.distcp" if i % 10 else f"extra/part{i % 7}/__{i}_0.distcp"
        data = os.urandom(rng.randint(1024, 4096))
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
        written[rel] = data
    if metadata:
        (ckpt / ".metadata").write_bytes(b"metadata")
        written[".metadata"] = b"metadata"
    return written


def _split(
    requests: list[RequestRecord], files: set[str], checkpoint: str
) -> tuple[collections.Counter[str], int]:
    """Requests on each file's object (by path below ``checkpoint``), and how many
    others there were."""
    per_file: collections.Counter[str] = collections.Counter()
    others = 0
    for r in requests:
        rel = r.path.split(f"/{checkpoint}/", 1)[-1] if f"/{checkpoint}/" in r.path else ""
        if rel in files:
            per_file[rel] += 1
        else:
            others += 1
    return per_file, others


def _config(tmp_path: Path, watch: Path, dest: str, endpoint: str) -> Path:
    config = tmp_path / "ckptd.toml"
    config.write_text(
        f'[[watch]]\ndir = "{watch}"\nsettle_seconds = 0\n'
        f'[destination]\nurl = "{dest}"\nendpoint_url = "{endpoint}"\n'
        f'[preemption]\nprovider = "none"\n[metrics]\nlisten = "127.0.0.1:0"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n'
    )
    return config


def test_two_thousand_small_files_commit_and_restore_byte_identical_in_one_request_per_file(
    tmp_path: Path, fault_proxy: FaultProxy, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    watch = tmp_path / "run"
    ckpt = watch / "step-100"
    written = _write_shards(ckpt, 2000, seed=1)
    old = time.time() - 60  # already quiet: the completion rule needs no wait
    for path in ckpt.rglob("*"):
        os.utime(path, (old, old))
    config = _config(tmp_path, watch, s3_dest, fault_proxy.url)

    done = run_cli("run", "--once", config=config, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    per_file, others = _split(fault_proxy.requests, set(written), "step-100")
    assert per_file == {rel: 1 for rel in written}, "a file took more (or fewer) than one PUT"
    assert {r.method for r in fault_proxy.requests if r.path.endswith(".distcp")} == {"PUT"}
    assert others <= PER_CHECKPOINT_UP
    # In the store: every object's bytes are the file's, and the manifest's CRC-32C agrees
    # with an independent implementation over what the store holds.
    manifest = committed_manifest(s3_client, s3_prefix, "run", "step-100")
    assert manifest is not None
    assert {f["path"]: f["size"] for f in manifest["files"]} == {
        rel: len(data) for rel, data in written.items()
    }
    sample = random.Random(2).sample(sorted(manifest["files"], key=lambda f: f["path"]), 50)
    for entry in sample:
        key = f"{s3_prefix}/run/step-100/{entry['path']}"
        body = s3_client.get_object(Bucket="ckpt", Key=key)["Body"].read()
        assert body == written[entry["path"]]
        assert entry["crc32c"] == f"{independent_crc.crc32c(body):08x}"

    fault_proxy.reset_counters()
    target = tmp_path / "restored"
    back = run_cli(
        "restore", "--run", "run", "--latest", "--to", str(target), config=config, timeout=300
    )
    assert back.returncode == 0, back.stderr[-3000:]
    per_file, others = _split(fault_proxy.requests, set(written), "step-100")
    assert per_file == {rel: 1 for rel in written}, "a file took more (or fewer) than one GET"
    assert others <= PER_CHECKPOINT_DOWN
    assert local_files(target / "step-100") == written


def test_small_files_written_while_watched_go_early_in_batches_each_sent_once(
    tmp_path: Path, fault_proxy: FaultProxy, s3_client: Any, s3_prefix: str, s3_dest: str
) -> None:
    """Shards closed and quiet before ``.metadata`` exists go early, through the lanes,
    a batch said in one log line; none is sent twice, and what commits is what was
    written."""
    watch = tmp_path / "run"
    watch.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": watch, "settle_seconds": 0.5}],
        dest=s3_dest,
        endpoint_url=fault_proxy.url,
        state_dir=tmp_path / "state",
    )
    with daemon:
        ckpt = watch / "step-200"
        # The commit record comes last, once shards went early.
        written = _write_shards(ckpt, 600, seed=3, metadata=False)
        wait_until(
            lambda: daemon.events_named("early_batch_done", checkpoint="step-200"),
            60,
            "a batch of shards sent early",
            details=daemon.log_text,
        )
        (ckpt / ".metadata").write_bytes(b"metadata")
        written[".metadata"] = b"metadata"
        (committed,) = wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="step-200"),
            120,
            "the commit",
            details=daemon.log_text,
        )
        lines = len(daemon.log_text().splitlines())
    assert committed["early"] >= 500, committed
    puts = [r for r in fault_proxy.requests if r.method == "PUT"]
    per_file, _ = _split(puts, set(written), "step-200")
    assert per_file == {rel: 1 for rel in written}, "a file was sent twice, or not at all"
    assert lines < 100, f"{lines} log lines for 601 files: not one line per file"
    manifest = committed_manifest(s3_client, s3_prefix, "run", "step-200")
    assert manifest is not None
    assert {f["path"] for f in manifest["files"]} == set(written)
    for entry in random.Random(4).sample(manifest["files"], 40):
        key = f"{s3_prefix}/run/step-200/{entry['path']}"
        assert s3_client.get_object(Bucket="ckpt", Key=key)["Body"].read() == written[entry["path"]]
