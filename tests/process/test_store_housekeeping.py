"""``ckptd prune``, ``ckptd rm`` and ``ckptd check`` as processes, on SeaweedFS and on a
``file://`` directory, each judged by the test's own listing and reads of the store
(boto3, or the directory itself), never by ckptd's.

The store is laid out with ckptd's own commit (``commit_files``); what is expected after
each command is worked out here from what was written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptd.core import checksum
from ckptd.devtools.locals3 import LocalS3
from ckptd.storage import RetryingStorage, open_storage
from tests.conftest import BUCKET
from tests.integration.test_restore import commit_files
from tests.support.daemon import run_cli

MANIFEST = "ckptd.manifest.json"


@dataclass
class Store:
    """One store under test: the flags that name it, ckptd's storage (to lay it out),
    and the test's own reader of every object under it."""

    flags: tuple[str, ...]
    storage: RetryingStorage
    objects: Callable[[], dict[str, bytes]]  # key (relative to the root) -> bytes


@pytest.fixture(params=["s3", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "s3":
        local_s3: LocalS3 = request.getfixturevalue("local_s3")
        s3: Any = request.getfixturevalue("s3_client")
        prefix: str = request.getfixturevalue("s3_prefix")
        dest = f"s3://{BUCKET}/{prefix}"

        def listed() -> dict[str, bytes]:
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/")
            keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
            return {
                k[len(prefix) + 1 :]: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()
                for k in keys
            }

        return Store(
            ("--dest", dest, "--endpoint-url", local_s3.endpoint_url),
            open_storage(dest, endpoint_url=local_s3.endpoint_url, max_attempts=2),
            listed,
        )
    root = tmp_path / "store"
    root.mkdir()

    def walked() -> dict[str, bytes]:
        return {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in root.rglob("*")
            if p.is_file() and not p.name.startswith(".")  # the backend's own temp files
        }

    return Store(("--dest", root.as_uri()), open_storage(root.as_uri()), walked)


def _files(run: str, name: str) -> dict[str, bytes]:
    """The bytes of checkpoint ``run/name``: distinct per checkpoint, one nested file."""
    return {"model.bin": f"{run}/{name}".encode() * 50, "sub/config.json": b'{"v": 1}'}


def _lay_out(store: Store) -> None:
    """run1: ck-1 .. ck-6 committed (LATEST at ck-6), and ck-0 an orphan (objects, no
    manifest); run2: ck-1 and ck-2 committed."""
    for step in range(1, 7):
        commit_files(store.storage, "run1", f"ck-{step}", _files("run1", f"ck-{step}"), step=step)
    data = b"left by a cut-short delete"
    store.storage.put_bytes("run1/ck-0/model.bin", data, crc32c=checksum.crc32c(data))
    for step in (1, 2):
        commit_files(store.storage, "run2", f"ck-{step}", _files("run2", f"ck-{step}"), step=step)


def _keys_of(objects: dict[str, bytes], run: str, name: str) -> set[str]:
    return {k for k in objects if k.startswith(f"{run}/{name}/")}


def _latest(objects: dict[str, bytes], run: str) -> dict[str, Any] | None:
    body = objects.get(f"{run}/LATEST")
    return None if body is None else dict(json.loads(body))


def _json(done: Any) -> Any:
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return json.loads(done.stdout)


def test_prune_is_dry_until_yes_then_deletes_exactly_what_it_said(store: Store) -> None:
    _lay_out(store)
    before = store.objects()
    keep_two = {"CKPTD_RETENTION__KEEP_LAST": "2"}  # retention as configured

    dry = _json(run_cli("prune", *store.flags, "--json", env=keep_two))
    assert store.objects() == before  # a dry run touches nothing
    (tier,) = dry["tiers"]
    said = [(a["kind"], a["run"], a["name"]) for a in tier["actions"]]
    victims = [("checkpoint", "run1", f"ck-{s}") for s in range(1, 5)]
    assert said == [*victims, ("orphan", "run1", "ck-0")]  # run2 holds only its newest 2
    for action in tier["actions"]:
        assert action["objects"] == len(_keys_of(before, action["run"], action["name"]))

    done = _json(run_cli("prune", *store.flags, "--yes", "--json", env=keep_two))
    assert done["tiers"][0]["actions"] == tier["actions"]  # what the dry run said, done
    after = store.objects()
    gone = set().union(*(_keys_of(before, run, name) for _, run, name in said))
    # The orphan was withdrawn before its objects went: its withdrawal stays a while, so
    # a writer still uploading into it could never commit over what was deleted.
    marker = "run1/ck-0/ckptd.manifest.json"
    assert json.loads(after.pop(marker))["format"] == "ckptd.withdrawn/1"
    assert set(after) == set(before) - gone
    assert {k: before[k] for k in after} == after  # what stays is byte for byte as written
    assert _latest(after, "run1") == _latest(before, "run1")


def test_rm_refuses_latest_without_force_and_moves_latest_to_the_newest_that_stays(
    store: Store,
) -> None:
    _lay_out(store)
    before = store.objects()
    refused = run_cli("rm", *store.flags, "run1/ck-6", "--yes")
    assert refused.returncode == 1 and refused.stdout == "", refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("ckptd: run1/ck-6: LATEST names run1/ck-6") and "--force" in line
    dry = _json(run_cli("rm", *store.flags, "run1/ck-6", "--force", "--json"))
    assert store.objects() == before  # refused, then dry: nothing touched
    (plan,) = dry["tiers"]
    assert (plan["latest"], plan["latest_after"]) == ("ck-6", "ck-5")
    assert plan["objects"] == len(_keys_of(before, "run1", "ck-6"))

    _json(run_cli("rm", *store.flags, "run1/ck-6", "--force", "--yes", "--json"))
    after = store.objects()
    assert set(after) == set(before) - _keys_of(before, "run1", "ck-6")
    latest = _latest(after, "run1")
    assert latest is not None
    manifest = after[f"run1/ck-5/{MANIFEST}"]
    assert latest["checkpoint"] == "ck-5" and latest["step"] == 5
    assert latest["manifest_crc32c"] == checksum.to_hex(checksum.crc32c(manifest))
    assert {k: v for k, v in after.items() if k != "run1/LATEST"} == {
        k: v for k, v in before.items() if k in after and k != "run1/LATEST"
    }

    # A checkpoint LATEST does not name goes without --force; LATEST stays where it was.
    _json(run_cli("rm", *store.flags, "run1/ck-2", "--yes", "--json"))
    after_two = store.objects()
    assert set(after_two) == set(after) - _keys_of(after, "run1", "ck-2")
    assert _latest(after_two, "run1") == latest

    # A whole run: every object under it, LATEST included; the other run untouched.
    _json(run_cli("rm", *store.flags, "run2", "--force", "--yes", "--json"))
    assert store.objects() == {k: v for k, v in after_two.items() if not k.startswith("run2/")}

    if store.flags[1].startswith("file://"):  # the same code on both: once is enough
        nothing = run_cli("rm", *store.flags, "run2/ck-1")
        assert nothing.returncode == 1 and "nothing to remove" in nothing.stderr, nothing.stderr


def _write_local(watch: Path, name: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = watch / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _expected_state(objects: dict[str, bytes], run: str, watch: Path, name: str) -> str:
    """What the test makes of one name by itself: the store's objects under it (by its
    own listing and reads) against the local files, byte for byte."""
    manifest_key = f"{run}/{name}/{MANIFEST}"
    local = watch / name
    if manifest_key not in objects:
        return "only-local"
    if not local.exists():
        return "only-in-store"
    manifest = json.loads(objects[manifest_key])
    stored = {f["path"]: objects[f"{run}/{name}/{f['path']}"] for f in manifest["files"]}
    here = {
        p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()
    }
    return "identical" if stored == here else "differs"


def test_check_names_what_differs_and_what_is_on_one_side_only(
    store: Store, tmp_path: Path
) -> None:
    _lay_out(store)
    watch = tmp_path / "watch" / "run1"
    same = {n: _files("run1", n) for n in ("ck-4", "ck-5", "ck-6")}
    for name, files in same.items():
        _write_local(watch, name, files)
    flipped = bytearray(same["ck-5"]["model.bin"])
    flipped[7] ^= 1  # same size, one bit off
    (watch / "ck-5" / "model.bin").write_bytes(bytes(flipped))
    (watch / "ck-6" / "notes.txt").write_text("not shipped")  # a file the manifest lacks
    _write_local(watch, "ck-7", {"model.bin": b"saved, not shipped yet"})
    os.makedirs(watch / ".ckptd")  # ckptd's own: never a checkpoint

    checked = run_cli("check", *store.flags, "--watch", str(watch), "--json")
    assert checked.returncode == 1, checked.stderr
    doc = json.loads(checked.stdout)
    (run,) = doc["runs"]
    states = {c["checkpoint"]: c["state"] for c in run["checkpoints"]}
    objects = store.objects()
    committed = {k.split("/")[1] for k in objects if k.startswith("run1/") and k.endswith(MANIFEST)}
    names = committed | {p.name for p in watch.iterdir() if not p.name.startswith(".")}
    assert states == {n: _expected_state(objects, "run1", watch, n) for n in names}
    assert states["ck-4"] == "identical" and states["ck-7"] == "only-local"
    problems = {
        c["checkpoint"]: {p["path"]: p["problem"] for p in c["problems"]}
        for c in run["checkpoints"]
    }
    assert (
        list(problems["ck-5"]) == ["model.bin"]
        and "content differs" in problems["ck-5"]["model.bin"]
    )
    assert problems["ck-6"] == {"notes.txt": "here, and not in the manifest"}
    assert doc["ok"] is False

    # Only-in-store (ck-1 .. ck-3, as local retention leaves a watch dir) is no difference.
    (watch / "ck-5" / "model.bin").write_bytes(same["ck-5"]["model.bin"])
    (watch / "ck-6" / "notes.txt").unlink()
    (watch / "ck-7" / "model.bin").unlink()
    (watch / "ck-7").rmdir()
    clean = run_cli("check", *store.flags, "--watch", str(watch))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert (
        clean.stdout.splitlines()[-1]
        == "3 identical, 0 differ, 0 pruned by retention, 0 only here, 3 only in the store"
    )
    assert store.objects() == objects  # check writes nothing to the store


def test_check_tells_pruned_by_retention_from_never_shipped_and_sees_a_missing_object(
    store: Store, tmp_path: Path
) -> None:
    """A healthy run with remote retention (``keep_last = 2``, no local retention) is no
    difference: what retention removed from the store is ``pruned``; a checkpoint never
    shipped is ``only-local``; an object deleted behind ckptd's back makes its checkpoint
    differ, though every local file matches the manifest."""
    watch = tmp_path / "watch" / "run1"
    state = tmp_path / "state"
    for step in (1, 2, 3, 4):
        _write_local(watch, f"ck-{step}", {"model.bin": os.urandom(2048), "a.json": b"{}"})
    env = {"CKPTD_RETENTION__KEEP_LAST": "2"}
    flags = (*store.flags, "--watch", str(watch), "--state-dir", str(state))
    for name in ("ck-1", "ck-2", "ck-3", "ck-4"):
        (watch / name / "COMPLETE").write_text("")
    shipped = run_cli("run", "--once", *flags, "--layout", "marker", env=env)
    assert shipped.returncode == 0, shipped.stdout + shipped.stderr
    committed = {k.split("/")[1] for k in store.objects() if k.endswith(MANIFEST)}
    assert committed == {"ck-3", "ck-4"}  # retention removed ck-1 and ck-2 remotely
    _write_local(watch, "ck-5", {"model.bin": b"never shipped"})

    checked = run_cli("check", *flags, "--json")
    doc = json.loads(checked.stdout)
    states = {c["checkpoint"]: c["state"] for c in doc["runs"][0]["checkpoints"]}
    assert states == {
        "ck-1": "pruned",
        "ck-2": "pruned",
        "ck-3": "identical",
        "ck-4": "identical",
        "ck-5": "only-local",
    }
    assert checked.returncode == 1  # ck-5 only here: a difference
    (watch / "ck-5" / "model.bin").unlink()
    (watch / "ck-5").rmdir()
    clean = run_cli("check", *flags)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "PRUNED   run1/ck-1: committed from here, then removed from" in clean.stdout

    # An object of ck-4 deleted behind ckptd's back: the local files still match the
    # manifest, and check says what it could not find.
    store.storage.delete(["run1/ck-4/model.bin"])
    broken = run_cli("check", *flags, "--json")
    assert broken.returncode == 1
    rows = {c["checkpoint"]: c for c in json.loads(broken.stdout)["runs"][0]["checkpoints"]}
    assert rows["ck-4"]["state"] == "differs"
    assert rows["ck-4"]["problems"] == [{"path": "model.bin", "problem": "missing in the store"}]
    assert rows["ck-3"]["state"] == "identical"
