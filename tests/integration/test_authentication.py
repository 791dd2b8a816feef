"""Authenticated checkpoints, end to end: the real pipeline signs, the real CLI refuses.

Checkpoints are shipped by the in-process pipeline to SeaweedFS (a 12 MiB file in three
5 MiB parts, a small one, the marker); ``ckptd verify`` and ``ckptd restore`` run as
their own processes with ``[authentication]`` in their config. Refusals must exit 1
with one clear first line and leave nothing at ``DIR/NAME``. The forged object has the
same size and the same CRC-32C as the original (``forge_crc32c``: CRC-32C is affine over
GF(2), so four patched bytes restore any CRC), so only the digest can tell.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.commit import objects
from ckptd.config import AuthenticationConfig, load_settings
from ckptd.core import checksum
from ckptd.core.signing import KeyRing, key_id_of, load_key
from ckptd.devtools.locals3 import LocalS3
from ckptd.repository import Repository, object_key
from ckptd.runtime.metrics import Metrics
from ckptd.storage import open_destination
from ckptd.store.restore import RestoreError, RestoreRequest, restore
from ckptd.sync.journal import Journal
from ckptd.sync.pipeline import SyncPipeline
from tests.conftest import BUCKET
from tests.support.daemon import Daemon, run_cli, wait_until

MiB = 1024 * 1024
RUN = "run"


# -- forging --------------------------------------------------------------------------------


def forge_crc32c(data: bytes, target: int) -> bytes:
    """``data`` with its last 4 bytes replaced so that its CRC-32C is ``target``.

    crc(prefix + x) is affine in the 32 bits of x: base ^ sum of x_i * column_i, so
    solving one 32x32 system over GF(2) gives the x that reaches ``target``."""
    prefix = data[:-4]
    state = checksum.crc32c(prefix)
    base = checksum.crc32c(b"\0\0\0\0", state)
    columns = [checksum.crc32c((1 << i).to_bytes(4, "little"), state) ^ base for i in range(32)]
    # Gaussian elimination: rows are (column value, the x bits that make it).
    rows: list[tuple[int, int]] = [(columns[i], 1 << i) for i in range(32)]
    want, solution = target ^ base, 0
    basis: dict[int, tuple[int, int]] = {}
    for value, bits in rows:
        for pivot in sorted(basis, reverse=True):
            if value >> pivot & 1:
                value ^= basis[pivot][0]
                bits ^= basis[pivot][1]
        if value:
            basis[value.bit_length() - 1] = (value, bits)
    for pivot in sorted(basis, reverse=True):
        if want >> pivot & 1:
            want ^= basis[pivot][0]
            solution ^= basis[pivot][1]
    assert want == 0, "CRC-32C columns span every target"
    forged = prefix + solution.to_bytes(4, "little")
    assert checksum.crc32c(forged) == target and len(forged) == len(data)
    return forged


def test_forge_helper_keeps_size_and_crc_and_changes_the_bytes() -> None:
    data = os.urandom(1 * MiB + 77)
    evil = bytearray(data)
    evil[100:120] = b"import os; os.system"
    forged = forge_crc32c(bytes(evil), checksum.crc32c(data))
    assert forged != data and len(forged) == len(data)
    assert checksum.crc32c(forged) == checksum.crc32c(data)


# -- a destination, keys, shipping ----------------------------------------------------------


class Setup:
    def __init__(self, tmp: Path, endpoint: str, prefix: str) -> None:
        self.tmp, self.endpoint, self.prefix = tmp, endpoint, prefix
        self.url = f"s3://{BUCKET}/{prefix}"
        self.watch = tmp / "watch"
        self.watch.mkdir()
        self.shipped = 0

    def key(self, name: str) -> Path:
        path = self.tmp / f"{name}.key"
        if not path.exists():
            path.write_text(secrets.token_hex(32) + "\n")
        return path

    def auth(self, key: Path | None, verify: tuple[Path, ...] = ()) -> dict[str, Any]:
        if key is None:
            return {}
        return {"key_file": str(key), "verify_key_files": [str(v) for v in verify]}

    async def ship(self, name: str, key: Path | None, verify: tuple[Path, ...] = ()) -> None:
        """Write checkpoint ``name`` and ship it with a fresh pipeline and journal."""
        self.shipped += 1
        state = self.tmp / f"state-{self.shipped}"
        state.mkdir()
        settings = load_settings(
            overrides={
                "watch": [
                    {"dir": str(self.watch), "run_id": RUN, "layout": "marker", "ship_early": False}
                ],
                "destination": {
                    "url": self.url,
                    "endpoint_url": self.endpoint,
                    "part_size_mib": 5,
                    "concurrency": 2,
                    "max_attempts": 2,
                },
                "state": {"dir": str(state)},
                "retention": {"keep_last": 0},
                "authentication": self.auth(key, verify),
            },
            environ={},
        )
        ckpt = self.watch / name
        ckpt.mkdir()
        (ckpt / "weights.bin").write_bytes(os.urandom(12 * MiB))
        (ckpt / "config.json").write_bytes(b'{"layers": 2}')
        (ckpt / "COMPLETE").write_text("")
        journal = Journal(state)
        pipeline = SyncPipeline(
            settings, open_destination(settings.destination), journal, Metrics()
        )
        try:
            await pipeline.evaluate(RUN, name)
            assert await pipeline.drain_once()
            assert name in pipeline.runs[RUN].committed
        finally:
            await pipeline.close()
            journal.close()

    def config(self, key: Path | None, verify: tuple[Path, ...] = ()) -> Path:
        lines = [
            "[destination]",
            f"url = {json.dumps(self.url)}",
            f"endpoint_url = {json.dumps(self.endpoint)}",
        ]
        if key is not None:
            lines += ["[authentication]", f"key_file = {json.dumps(str(key))}"]
            lines.append(f"verify_key_files = {json.dumps([str(v) for v in verify])}")
        path = self.tmp / f"cli-{secrets.token_hex(4)}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def object(self, client: Any, name: str, path: str) -> bytes:
        key = f"{self.prefix}/{RUN}/{name}/{path}"
        return bytes(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    def replace(self, client: Any, name: str, path: str, data: bytes) -> None:
        client.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{RUN}/{name}/{path}", Body=data)

    def manifest(self, client: Any, name: str) -> dict[str, Any]:
        return dict(json.loads(self.object(client, name, "ckptd.manifest.json")))

    def verify(self, name: str, config: Path) -> Any:
        return run_cli("verify", "--run", RUN, "--checkpoint", name, config=config)

    def restore(self, name: str, config: Path, to: Path) -> Any:
        return run_cli(
            "restore",
            "--run",
            RUN,
            "--checkpoint",
            name,
            "--to",
            str(to),
            "--no-progress",
            config=config,
        )


@pytest.fixture
def setup(tmp_path: Path, local_s3: LocalS3, s3_prefix: str) -> Setup:
    return Setup(tmp_path, local_s3.endpoint_url, s3_prefix)


def assert_refused(result: Any, *needles: str) -> None:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    # stderr also carries the JSON log lines; the user's line is the one "ckptd: " line.
    said = [line for line in result.stderr.splitlines() if line.startswith("ckptd: ")]
    assert len(said) == 1, result.stderr
    first = said[0]
    for needle in needles:
        assert needle in first, result.stderr
    assert "Traceback" not in result.stderr


def assert_restored(result: Any, to: Path, name: str, original: Path) -> None:
    assert result.returncode == 0, result.stderr
    for path in ("weights.bin", "config.json"):
        assert (to / name / path).read_bytes() == (original / name / path).read_bytes()


# -- the tests ------------------------------------------------------------------------------


async def test_signed_manifest_carries_digests_and_key_id_and_restores(
    setup: Setup, s3_client: Any, tmp_path: Path
) -> None:
    k1 = setup.key("k1")
    await setup.ship("ck-1", k1)
    doc = setup.manifest(s3_client, "ck-1")
    assert doc["key_id"] == key_id_of(load_key(k1))
    assert doc["digest"] == "blake3-1mib-list" and len(doc["signature"]) == 64
    assert {f["path"] for f in doc["files"]} == {"weights.bin", "config.json", "COMPLETE"}
    assert all(len(f["digest"]) == 64 for f in doc["files"])
    config = setup.config(k1)
    assert setup.verify("ck-1", config).returncode == 0
    assert_restored(
        setup.restore("ck-1", config, tmp_path / "out"), tmp_path / "out", "ck-1", setup.watch
    )
    # Without a key configured, a signed checkpoint restores as any other.
    plain = setup.config(None)
    assert_restored(
        setup.restore("ck-1", plain, tmp_path / "o2"), tmp_path / "o2", "ck-1", setup.watch
    )


@pytest.mark.parametrize("path", ["weights.bin", "config.json"])
async def test_object_forged_with_same_size_and_crc32c_is_refused(
    setup: Setup, s3_client: Any, tmp_path: Path, path: str
) -> None:
    k1 = setup.key("k1")
    await setup.ship("ck-1", k1)
    original = setup.object(s3_client, "ck-1", path)
    evil = bytearray(original)
    n = min(8, len(evil) - 4)  # the last 4 bytes are the forger's
    evil[:n] = b"EVILCODE"[:n]
    setup.replace(s3_client, "ck-1", path, forge_crc32c(bytes(evil), checksum.crc32c(original)))
    config = setup.config(k1)

    # Without the key, CRC-32C and size cannot tell: the forgery passes (why keys exist).
    assert setup.verify("ck-1", setup.config(None)).returncode == 0

    result = setup.verify("ck-1", config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"BAD  {RUN}/ck-1/{path}: digest differs" in result.stdout
    to = tmp_path / "out"
    result = setup.restore("ck-1", config, to)
    assert_refused(result, "restore failed")
    assert "digest differs from the signed manifest" in result.stderr
    assert not (to / "ck-1").exists()


@pytest.mark.parametrize("edit", ["size", "digest", "crc32c", "extra-field"])
async def test_edited_manifest_is_refused(
    setup: Setup, s3_client: Any, tmp_path: Path, edit: str
) -> None:
    k1 = setup.key("k1")
    await setup.ship("ck-1", k1)
    doc = setup.manifest(s3_client, "ck-1")
    entry = next(f for f in doc["files"] if f["path"] == "config.json")
    if edit == "size":
        # Consistent otherwise (total_bytes follows), and the object is made to match.
        data = setup.object(s3_client, "ck-1", "config.json") + b" "
        setup.replace(s3_client, "ck-1", "config.json", data)
        entry["size"] += 1
        entry["crc32c"] = checksum.to_hex(checksum.crc32c(data))
        doc["total_bytes"] += 1
    elif edit == "digest":
        entry["digest"] = "0" * 64
    elif edit == "crc32c":
        entry["crc32c"] = "00000000"
    else:
        doc["note"] = "harmless?"
    setup.replace(s3_client, "ck-1", "ckptd.manifest.json", json.dumps(doc).encode())
    config = setup.config(k1)
    assert_refused(setup.verify("ck-1", config), "signature does not match")
    to = tmp_path / "out"
    assert_refused(setup.restore("ck-1", config, to), "restore refused", "signature does not match")
    assert not to.exists() or not any(to.iterdir())


async def test_unsigned_manifest_is_refused_when_a_key_is_configured(
    setup: Setup, tmp_path: Path
) -> None:
    await setup.ship("ck-1", None)
    config = setup.config(setup.key("k1"))
    assert_refused(setup.verify("ck-1", config), "not signed")
    to = tmp_path / "out"
    assert_refused(setup.restore("ck-1", config, to), "restore refused", "not signed")
    assert not to.exists() or not any(to.iterdir())
    # Without a key it is an ordinary checkpoint.
    assert_restored(setup.restore("ck-1", setup.config(None), to), to, "ck-1", setup.watch)


async def test_key_rotation(setup: Setup, s3_client: Any, tmp_path: Path) -> None:
    k1, k2 = setup.key("k1"), setup.key("k2")
    id1, id2 = key_id_of(load_key(k1)), key_id_of(load_key(k2))
    await setup.ship("ck-1", k1)
    # The daemon now signs with K2 and still accepts K1.
    await setup.ship("ck-2", k2, (k1,))
    assert setup.manifest(s3_client, "ck-1")["key_id"] == id1
    assert setup.manifest(s3_client, "ck-2")["key_id"] == id2
    both = setup.config(k2, (k1,))
    for name in ("ck-1", "ck-2"):
        assert setup.verify(name, both).returncode == 0
        to = tmp_path / f"both-{name}"
        assert_restored(setup.restore(name, both, to), to, name, setup.watch)
    # K1 retired: old checkpoints are refused by its id, new ones still restore.
    only2 = setup.config(k2)
    to = tmp_path / "only2"
    assert_refused(setup.restore("ck-1", only2, to), "unknown key id", id1)
    assert not (to / "ck-1").exists()
    assert_refused(setup.verify("ck-1", only2), "unknown key id", id1)
    assert_restored(setup.restore("ck-2", only2, to), to, "ck-2", setup.watch)


def test_daemon_signs_early_shipped_files_and_never_shows_the_key(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, s3_prefix: str, s3_client: Any
) -> None:
    """The real daemon, an hf checkpoint whose model goes early (before the trainer's
    record): the committed manifest is signed and the early file's digest holds on
    restore; the key is nowhere in the daemon's log (debug), /v1/status or config check."""
    key_text = secrets.token_hex(32)
    key_file = tmp_path / "manifest.key"
    key_file.write_text(key_text + "\n")
    watch = tmp_path / "watch"
    watch.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": watch, "run_id": RUN, "settle_seconds": 0.3}],
        dest=s3_dest,
        endpoint_url=local_s3.endpoint_url,
        state_dir=tmp_path / "state",
        part_size_mib=5,
    )
    with open(daemon.config, "a") as fh:
        fh.write(f"[authentication]\nkey_file = {json.dumps(str(key_file))}\n")
    daemon.extra_args = ["--log-level", "debug"]
    ckpt = watch / "checkpoint-5"
    with daemon:
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(os.urandom(7 * MiB))
        (ckpt / "config.json").write_text('{"model_type": "gpt2"}')
        wait_until(
            lambda: daemon.events_named("early_upload_done", path="model.safetensors"),
            60,
            "the model's early upload",
        )
        (ckpt / "trainer_state.json").write_text('{"global_step": 5}')
        (committed,) = wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="checkpoint-5"),
            60,
            "commit",
        )
        status = json.dumps(daemon.get_json("/v1/status"))
    # The model went before the record: taken over in flight ("early") or, done by then,
    # read again for its digest ("skipped"); either way its digest is in the manifest.
    assert committed["early"] + committed["skipped"] >= 1
    key = f"{s3_prefix}/{RUN}/checkpoint-5/ckptd.manifest.json"
    doc = json.loads(s3_client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert doc["key_id"] == key_id_of(load_key(key_file))
    assert all(f.get("digest") for f in doc["files"])
    config = tmp_path / "cli.toml"
    config.write_text(
        f"[destination]\nurl = {json.dumps(s3_dest)}\n"
        f"endpoint_url = {json.dumps(local_s3.endpoint_url)}\n"
        f"[authentication]\nkey_file = {json.dumps(str(key_file))}\n"
    )
    to = tmp_path / "out"
    result = run_cli(
        "restore", "--run", RUN, "--latest", "--to", str(to), "--no-progress", config=config
    )
    assert result.returncode == 0, result.stderr
    assert (to / "checkpoint-5" / "model.safetensors").read_bytes() == (
        ckpt / "model.safetensors"
    ).read_bytes()

    config_out = run_cli("config", "check", config=daemon.config)
    assert config_out.returncode == 0, config_out.stderr
    assert str(key_file) in config_out.stdout  # the path is shown...
    log = daemon.log_text()
    assert "checkpoint_committed" in log
    for text in (log, status, config_out.stdout, config_out.stderr, result.stderr):
        assert key_text not in text  # ...the key never
        assert key_text.encode().hex() not in text


# -- many nodes ------------------------------------------------------------------------------


async def test_many_nodes_parts_carry_digests_and_the_union_is_signed(tmp_path: Path) -> None:
    """Two nodes (pipelines) on a shared directory: each part lists its node's digests;
    the union is signed by the node that commits it, restores whole and by part, and a
    forged shard of node 1 is refused."""
    from tests.integration.test_cluster_sync import Node, age, dcp_save, drive, union

    key = tmp_path / "k.key"
    key.write_text(secrets.token_hex(32))
    dest = (f"file://{tmp_path / 'shared'}", "")
    nodes = [Node(tmp_path, 0, dest), Node(tmp_path, 1, dest)]
    for node in nodes:
        node.settings = node.settings.model_copy(
            update={"authentication": AuthenticationConfig(key_file=str(key))}
        )
    repo = Repository(nodes[0].storage())
    keys = KeyRing.from_files(key)
    try:
        dcp_save(nodes[0], nodes[1])
        for node in nodes:
            age(node.root)
            await node.start()
        await drive(nodes, lambda: repo.read_manifest(RUN, "step-10") is not None)
    finally:
        for node in nodes:
            await node.stop()
    manifest = repo.read_manifest(RUN, "step-10")
    assert manifest is not None and manifest.nodes == 2
    keys.check(manifest)  # signed, by the one key every node holds
    for rank in (0, 1):
        part = objects.read_part(repo, RUN, "step-10", rank)
        assert part is not None and part.files
        assert all(f.digest and f.digest == manifest.file_map()[f.path].digest for f in part.files)
    expected = union(nodes[0], nodes[1], "step-10")
    whole = restore(
        repo.storage, RestoreRequest(RUN, None, tmp_path / "all", progress=False, keys=keys)
    )
    assert {
        p.relative_to(whole.path).as_posix() for p in whole.path.rglob("*") if p.is_file()
    } == set(expected)
    restore(
        repo.storage,
        RestoreRequest(RUN, "step-10", tmp_path / "p1", progress=False, keys=keys, part=1),
    )

    shard = "__2_0.distcp"  # node 1's
    data = repo.storage.get_bytes(object_key(RUN, "step-10", shard))
    # The first byte flipped (set to 0x80, it was already that once in 256 runs: CI).
    forged = forge_crc32c(bytes([data[0] ^ 0x80]) + data[1:], checksum.crc32c(data))
    assert forged != data
    (tmp_path / "shared" / RUN / "step-10" / shard).write_bytes(forged)
    with pytest.raises(RestoreError) as caught:
        restore(
            repo.storage,
            RestoreRequest(RUN, "step-10", tmp_path / "bad", progress=False, keys=keys),
        )
    assert [p.path for p in caught.value.problems] == [shard]
    assert not (tmp_path / "bad" / "step-10").exists()


# -- ckptd exec: the restore before the trainer starts ----------------------------------------


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
async def test_exec_restores_only_a_signed_checkpoint_before_the_trainer_starts(
    setup: Setup, tmp_path: Path, signed: bool
) -> None:
    from tests.support.exec_harness import ExecNode
    from tests.support.harness import RUN_ID, Env

    assert RUN_ID == RUN
    key = setup.key("k1")
    await setup.ship("ck-1", key if signed else None)
    started = tmp_path / "trainer-started"
    node = ExecNode(
        tmp_path / "node",
        spec=None,  # type: ignore[arg-type] - command given: no trainer spec needed
        env=Env(setup.url, setup.endpoint),
        max_restarts=0,
        command=[sys.executable, "-c", f"open({str(started)!r}, 'w').close()"],
        extra_config=f"[authentication]\nkey_file = {json.dumps(str(key))}\n",
    )
    try:
        node.start()
        code = node.wait_exit(120)
    finally:
        node.close()
    restored = node.ckpt / "ck-1"
    if signed:
        assert code == 0, node.log_tail()
        assert started.exists()
        assert (restored / "weights.bin").read_bytes() == (
            setup.watch / "ck-1" / "weights.bin"
        ).read_bytes()
    else:
        assert code == 1, node.log_tail()
        assert "not signed" in node.log_tail()
        assert not started.exists()  # the trainer never ran
        assert not restored.exists()


# -- digests of parts sent before a restart -----------------------------------------------------


@pytest.mark.parametrize("changed", [False, True], ids=["unchanged", "part-rewritten"])
async def test_a_resumed_upload_reads_its_sent_parts_again_for_the_digest(
    tmp_path: Path, changed: bool
) -> None:
    """Parts 1-2 of 3 are sent, then the upload pauses; a fresh Transfers (a restarted
    daemon) resumes it with digests on: the digest is the whole file's, and a sent part
    whose bytes changed since (size and mtime kept) stops the upload instead of being
    signed as what was sent."""
    from ckptd.core import digest
    from ckptd.layouts.base import FileEntry
    from ckptd.storage import open_storage
    from ckptd.sync.transfer import (
        CheckpointChangedError,
        TransferContext,
        TransferPausedError,
        Transfers,
    )

    storage = open_storage(f"file://{tmp_path / 'store'}")
    journal = Journal(tmp_path / "state")
    local = tmp_path / "weights.bin"
    local.write_bytes(os.urandom(12 * MiB))
    st = local.stat()
    entry = FileEntry("weights.bin", st.st_size, st.st_mtime_ns)
    ctx = TransferContext(RUN, "ck-1")

    sent: list[int] = []

    def on_bytes(run: str, n: int) -> None:
        sent.append(n)
        if len(sent) == 2:
            ctx.pause.set()  # one worker: parts 1 and 2 are sent and journalled

    first = Transfers(
        storage, journal, part_size=5 * MiB, concurrency=1, on_bytes=on_bytes, digests=True
    )
    try:
        with pytest.raises(TransferPausedError):
            await first.upload("k", local, entry, ctx)
    finally:
        first.close()
    if changed:
        with open(local, "r+b") as fh:  # part 1's bytes, same size, same mtime
            fh.write(b"\xff" * 16)
        os.utime(local, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = Transfers(storage, journal, part_size=5 * MiB, concurrency=2, digests=True)
    try:
        if changed:
            with pytest.raises(CheckpointChangedError, match="changed since part 1"):
                await second.upload("k", local, entry, TransferContext(RUN, "ck-1"))
        else:
            result = await second.upload("k", local, entry, TransferContext(RUN, "ck-1"))
            assert result.how == "resumed" and result.bytes_sent == 2 * MiB
            assert result.digest == digest.digest_of_bytes(local.read_bytes())
    finally:
        second.close()
        journal.close()
