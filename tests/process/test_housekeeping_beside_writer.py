"""``ckptd rm`` and ``ckptd prune`` beside a real daemon that is still uploading the
checkpoint they would delete (issue 44, item 1), on SeaweedFS and on a ``file://`` store.

Before withdrawals (``ckptd.commit.withdrawal``) both deleted objects of a slot being
uploaded, and the daemon then committed a manifest over the hole. Here the trainer is the
test: it writes an HF ``checkpoint-N/`` into the watch dir, the daemon ships its large
files early at a capped rate (so they are on their way while the command runs), and only
after the command does the test write ``trainer_state.json``, the record that makes the
checkpoint complete: the daemon's commit point always comes after the deletion, however
loaded the machine is.

- ``rm`` without ``--force`` is refused in one line naming the writer's host and the
  claim's age, deleting nothing; ``rm --force --yes`` withdraws the slot; the daemon is
  then refused at its commit (``checkpoint_slot_withdrawn``), never commits the name, and
  keeps its local copy; LATEST and the committed checkpoints are untouched.
- ``prune --yes`` with ``keep_last = 2`` keeps an uncommitted checkpoint below the kept
  window while its claim is live, and the daemon commits it whole.
- The writer's side killed: the daemon ``kill -9``ed mid-upload, ``rm --force`` while it
  is down, the daemon restarted: refused at its commit, never commits the name.

Every verdict on the store is the test's own listing and reads (boto3, or the directory),
byte for byte against what the test wrote.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from crc32c import crc32c  # a second CRC-32C implementation, not the one ckptd uses

from ckptd.devtools.locals3 import LocalS3
from tests.conftest import BUCKET
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.writers import local_files, write_bytes

MiB = 1024 * 1024
RUN = "race"
MANIFEST = "ckptd.manifest.json"
CLAIM = "ckptd.claim.json"
# The checkpoint being uploaded: two large files at RATE MiB/s take a few seconds, so
# they are on their way while the command runs (what happens is the same if a starved
# test process finds them sent already: the checkpoint stays uncommitted until the test
# writes its record).
BIG = 8 * MiB
RATE = 3


@dataclass
class Store:
    """One destination: its URL and endpoint for the daemon and the CLI, and the test's
    own reader of every object under it (key relative to the destination's root)."""

    dest: str
    endpoint: str
    objects: Callable[[str], dict[str, bytes]]  # prefix -> {key: bytes}

    def keys(self, prefix: str) -> set[str]:
        return set(self.objects(prefix))


@pytest.fixture(params=["s3", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "s3":
        local_s3: LocalS3 = request.getfixturevalue("local_s3")
        s3: Any = request.getfixturevalue("s3_client")
        root: str = request.getfixturevalue("s3_prefix")

        def listed(prefix: str) -> dict[str, bytes]:
            pages = s3.get_paginator("list_objects_v2").paginate(
                Bucket=BUCKET, Prefix=f"{root}/{prefix}"
            )
            out = {}
            for key in (o["Key"] for page in pages for o in page.get("Contents", [])):
                try:
                    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
                except s3.exceptions.NoSuchKey:
                    continue  # deleted between the listing and the read
                out[key[len(root) + 1 :]] = body
            return out

        return Store(f"s3://{BUCKET}/{root}", local_s3.endpoint_url, listed)
    base = tmp_path / "store"
    base.mkdir()

    def walked(prefix: str) -> dict[str, bytes]:
        out = {}
        for path in base.rglob("*"):
            key = path.relative_to(base).as_posix()
            # Not the backend's own temp files (dot names).
            if key.startswith(prefix) and not path.name.startswith(".") and path.is_file():
                try:
                    out[key] = path.read_bytes()
                except FileNotFoundError:
                    continue
        return out

    return Store(base.as_uri(), "", walked)


def _daemon(tmp_path: Path, store: Store, root: Path) -> Daemon:
    root.mkdir()
    return Daemon.configured(
        tmp_path,
        watch=[{"dir": root, "settle_seconds": 0.3}],
        dest=store.dest,
        endpoint_url=store.endpoint,
        state_dir=tmp_path / "state",
        part_size_mib=5,
        max_upload_mib_per_s=RATE,
    )


def _save(root: Path, step: int, big: int, *, complete: bool = True) -> dict[str, bytes]:
    """An HF ``Trainer`` save of ``checkpoint-<step>`` (model and config, optimizer,
    then ``trainer_state.json`` last, unless not ``complete``); its files' bytes."""
    d = root / f"checkpoint-{step}"
    files = {"model.safetensors": write_bytes(d / "model.safetensors", big)}
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    files["config.json"] = b'{"model_type": "gpt2"}'
    files["optimizer.pt"] = write_bytes(d / "optimizer.pt", big)
    if complete:
        files.update(_finish(root, step))
    return files


def _finish(root: Path, step: int) -> dict[str, bytes]:
    body = json.dumps({"global_step": step}).encode()
    (root / f"checkpoint-{step}" / "trainer_state.json").write_bytes(body)
    return {"trainer_state.json": body}


def _committed(daemon: Daemon, *steps: int) -> None:
    """Wait until the daemon logged each ``checkpoint-<step>`` committed."""
    for step in steps:
        wait_until(
            partial(daemon.events_named, "checkpoint_committed", checkpoint=f"checkpoint-{step}"),
            90,
            f"checkpoint-{step} committed",
            interval=0.1,
            details=lambda: daemon.log_text()[-4000:],
        )


def _manifests(store: Store) -> dict[str, dict[str, Any]]:
    """Every document at a manifest key of the run, by slot."""
    return {
        key.split("/")[1]: json.loads(body)
        for key, body in store.objects(f"{RUN}/").items()
        if key.endswith(f"/{MANIFEST}")
    }


def _stored_files(store: Store, slot: str, manifest: dict[str, Any]) -> dict[str, bytes]:
    """The bytes of each file a manifest names, read from the store."""
    objects = store.objects(f"{RUN}/{slot}/")
    return {
        f["path"]: objects.get(f"{RUN}/{slot}/{f['path']}", b"<missing>") for f in manifest["files"]
    }


def _assert_every_commit_whole(store: Store, written: dict[str, dict[str, bytes]]) -> set[str]:
    """Every committed manifest of the run names exactly the files the test wrote under
    its name, and each object reads back byte-identical; returns the committed names."""
    committed = set()
    for slot, doc in _manifests(store).items():
        if doc.get("format") != "ckptd.manifest/1":
            continue
        name = doc.get("name") or doc["checkpoint"]  # the local name, when not the slot's
        assert name in written, f"{slot} committed, and the test never wrote {name}"
        stored = _stored_files(store, slot, doc)
        assert stored == written[name], f"{slot}: not what was written"
        for entry in doc["files"]:  # and the manifest says what is there
            data = stored[entry["path"]]
            assert (entry["size"], entry["crc32c"]) == (len(data), f"{crc32c(data):08x}"), entry
        committed.add(name)
    return committed


def _latest(store: Store) -> dict[str, Any]:
    return dict(json.loads(store.objects(f"{RUN}/LATEST")[f"{RUN}/LATEST"]))


def test_rm_refuses_a_checkpoint_being_uploaded_and_force_withdraws_it(
    store: Store, tmp_path: Path
) -> None:
    root = tmp_path / RUN
    written: dict[str, dict[str, bytes]] = {}
    slot = f"{RUN}/checkpoint-600/"
    with _daemon(tmp_path, store, root) as daemon:
        written["checkpoint-500"] = _save(root, 500, 1 * MiB)
        _committed(daemon, 500)

        saving = time.time()
        written["checkpoint-600"] = _save(root, 600, BIG, complete=False)
        wait_until(
            lambda: (
                f"{slot}{CLAIM}" in store.keys(slot)
                and daemon.events_named("early_upload_started", checkpoint="checkpoint-600")
            ),
            60,
            "checkpoint-600 claimed and its early upload started",
            details=lambda: daemon.log_text()[-4000:],
        )
        before = store.objects(slot)

        refused = run_cli("rm", f"{RUN}/checkpoint-600", "--yes", config=daemon.config)
        assert refused.returncode == 1, refused.stderr
        assert refused.stdout == "" and "Traceback" not in refused.stderr, refused.stderr
        (line,) = refused.stderr.strip().splitlines()
        assert line.startswith(f"ckptd: {RUN}/checkpoint-600: "), line
        assert f"being uploaded by {socket.gethostname()}" in line, line
        age = re.search(r"claimed (\d+) s ago", line)
        assert age is not None, line
        # This save's claim (claimed_at is truncated to whole seconds, the age rounded).
        assert int(age.group(1)) <= time.time() - saving + 2, line
        assert "--force" in line, line
        after = store.objects(slot)
        # Refused before deleting anything: every object stays as it was (an upload in
        # flight may have added more), and nothing stands at the manifest key.
        assert {k: after.get(k) for k in before} == before
        assert f"{slot}{MANIFEST}" not in after

        forced = run_cli(
            "rm", f"{RUN}/checkpoint-600", "--force", "--yes", "--json", config=daemon.config
        )
        assert forced.returncode == 0, forced.stderr
        assert "Traceback" not in forced.stderr, forced.stderr
        (tier,) = json.loads(forced.stdout)["tiers"]
        assert list(tier["uploading"]) == ["checkpoint-600"], tier
        assert socket.gethostname() in tier["uploading"]["checkpoint-600"], tier
        assert [s["kind"] for s in tier["steps"]] == ["uncommitted"], tier
        withdrawal = json.loads(store.objects(f"{slot}{MANIFEST}")[f"{slot}{MANIFEST}"])
        assert withdrawal["format"] == "ckptd.withdrawn/1", withdrawal
        assert withdrawal["by"] == "rm", withdrawal

        # The trainer finishes its save: the daemon reaches its commit point after the
        # withdrawal, and must be refused there.
        written["checkpoint-600"].update(_finish(root, 600))
        outcome = wait_until(
            lambda: (
                daemon.events_named("checkpoint_slot_withdrawn", checkpoint="checkpoint-600")
                or daemon.events_named("checkpoint_committed", checkpoint="checkpoint-600")
            ),
            90,
            "the daemon's commit of checkpoint-600 refused (or done)",
            interval=0.1,
            details=lambda: daemon.log_text()[-4000:],
        )
        (refusal,) = outcome
        assert refusal["event"] == "checkpoint_slot_withdrawn", daemon.log_text()[-4000:]
        assert refusal["theirs"]["withdrawn_by"] == "rm", refusal
        assert daemon.events_named("checkpoint_conflict_writers", checkpoint="checkpoint-600")
        # What it sent into the withdrawn slot goes; only the withdrawal stays.
        wait_until(
            lambda: store.keys(slot) == {f"{slot}{MANIFEST}"},
            60,
            "checkpoint-600's slot emptied but for its withdrawal",
            details=lambda: f"{sorted(store.keys(slot))}\n{daemon.log_text()[-3000:]}",
        )
        status = daemon.get_json("/v1/status")
        code = daemon.stop()
    assert code == 0, daemon.log_text()[-4000:]
    assert not daemon.events_named("checkpoint_committed", checkpoint="checkpoint-600")
    # The conflict is shown, not hidden.
    shown = status["runs"][RUN]["conflicts"]["checkpoint-600"]
    assert shown["theirs"]["withdrawn_by"] == "rm", shown

    final = store.objects(slot)
    assert set(final) == {f"{slot}{MANIFEST}"}
    assert json.loads(final[f"{slot}{MANIFEST}"]) == withdrawal  # never overwritten
    # The local copy is kept, byte for byte.
    assert local_files(root / "checkpoint-600") == written["checkpoint-600"]
    assert _assert_every_commit_whole(store, written) == {"checkpoint-500"}
    assert _latest(store)["checkpoint"] == "checkpoint-500"

    target = tmp_path / "restored"
    restored = run_cli(
        "restore", "--run", RUN, "--latest", "--to", str(target), config=daemon.config
    )
    assert restored.returncode == 0, restored.stderr
    assert local_files(target / "checkpoint-500") == written["checkpoint-500"]


def test_prune_keeps_an_old_checkpoint_being_uploaded_and_it_commits_whole(
    store: Store, tmp_path: Path
) -> None:
    root = tmp_path / RUN
    written: dict[str, dict[str, bytes]] = {}
    slot = f"{RUN}/checkpoint-250/"
    with _daemon(tmp_path, store, root) as daemon:
        for step in (300, 400, 500):
            written[f"checkpoint-{step}"] = _save(root, step, 256 * 1024)
        _committed(daemon, 300, 400, 500)

        # A checkpoint below the committed ones on its way (a late save, a slow node).
        written["checkpoint-250"] = _save(root, 250, BIG, complete=False)
        wait_until(
            lambda: (
                f"{slot}{CLAIM}" in store.keys(slot)
                and daemon.events_named("early_upload_started", checkpoint="checkpoint-250")
            ),
            60,
            "checkpoint-250 claimed and its early upload started",
            details=lambda: daemon.log_text()[-4000:],
        )
        before = store.objects(slot)
        pruned = run_cli(
            "prune",
            "--yes",
            "--json",
            "--log-level",
            "info",
            config=daemon.config,
            env={"CKPTD_RETENTION__KEEP_LAST": "2"},
        )
        assert pruned.returncode == 0, pruned.stderr
        assert "Traceback" not in pruned.stderr, pruned.stderr
        (tier,) = json.loads(pruned.stdout)["tiers"]
        said = [(a["kind"], a["run"], a["name"]) for a in tier["actions"]]
        assert said == [("checkpoint", RUN, "checkpoint-300")], said
        logged = [json.loads(x) for x in pruned.stderr.splitlines() if x.startswith("{")]
        kept = [e for e in logged if e.get("event") == "retention_in_flight_kept"]
        assert [e["checkpoint"] for e in kept] == ["checkpoint-250"], pruned.stderr
        assert socket.gethostname() in kept[0]["writer"], kept
        after = store.objects(slot)
        assert {k: after.get(k) for k in before} == before  # nothing of it deleted
        assert f"{slot}{MANIFEST}" not in after  # nor withdrawn
        assert not store.keys(f"{RUN}/checkpoint-300/")

        written["checkpoint-250"].update(_finish(root, 250))
        _committed(daemon, 250)
        code = daemon.stop()
    assert code == 0, daemon.log_text()[-4000:]
    assert not daemon.events_named("checkpoint_slot_withdrawn")
    assert not daemon.events_named("checkpoint_conflict_writers")

    committed = _assert_every_commit_whole(store, written)
    assert committed == {"checkpoint-250", "checkpoint-400", "checkpoint-500"}
    assert _latest(store)["checkpoint"] == "checkpoint-500"  # an older step never moves it
    for step in (250, 400, 500):  # and nothing local was touched
        assert local_files(root / f"checkpoint-{step}") == written[f"checkpoint-{step}"]


def test_a_writer_killed_mid_upload_and_restarted_after_rm_force_never_commits_the_hole(
    store: Store, tmp_path: Path
) -> None:
    """The writer's side killed: the daemon is ``kill -9``ed while checkpoint-600 uploads,
    ``rm --force`` withdraws the name while it is down, and the daemon restarted finds its
    claim in its journal and goes on; it is refused at the commit point, never commits."""
    root = tmp_path / RUN
    written: dict[str, dict[str, bytes]] = {}
    slot = f"{RUN}/checkpoint-600/"
    daemon = _daemon(tmp_path, store, root)
    with daemon:
        written["checkpoint-500"] = _save(root, 500, 256 * 1024)
        _committed(daemon, 500)
        written["checkpoint-600"] = _save(root, 600, BIG, complete=False)
        wait_until(
            lambda: daemon.events_named("early_upload_started", checkpoint="checkpoint-600"),
            60,
            "checkpoint-600's early upload started",
            details=lambda: daemon.log_text()[-4000:],
        )
        assert daemon.proc is not None
        daemon.proc.kill()  # kill -9, mid-upload
        daemon.proc.wait()
    forced = run_cli("rm", f"{RUN}/checkpoint-600", "--force", "--yes", config=daemon.config)
    assert forced.returncode == 0, forced.stderr
    written["checkpoint-600"].update(_finish(root, 600))
    with daemon:  # restarted: its journal holds the claim and what it sent
        wait_until(
            lambda: daemon.events_named("checkpoint_slot_withdrawn", checkpoint="checkpoint-600"),
            90,
            "the restarted daemon refused at checkpoint-600's commit",
            interval=0.1,
            details=lambda: daemon.log_text()[-4000:],
        )
        code = daemon.stop()
    assert code == 0, daemon.log_text()[-4000:]
    assert not daemon.events_named("checkpoint_committed", checkpoint="checkpoint-600")
    assert _assert_every_commit_whole(store, written) == {"checkpoint-500"}
    doc = json.loads(store.objects(f"{slot}{MANIFEST}")[f"{slot}{MANIFEST}"])
    assert doc["format"] == "ckptd.withdrawn/1"
    assert local_files(root / "checkpoint-600") == written["checkpoint-600"]
