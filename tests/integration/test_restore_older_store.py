"""A store written by the ckptd before its modules moved into packages restores, verifies and
lists with this one: the remote layout and formats did not change with the move.

``tests/fixtures/store_before_packages/store`` was committed by ckptd at fc54df2 (its
``record.py`` says how): two runs of two Hugging Face-shaped checkpoints each, the second a
server-side copy of the first's unchanged files, one run with signed manifests.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "store_before_packages"
EXPECTED: dict[str, dict[str, dict[str, str]]] = json.loads((FIXTURE / "expected.json").read_text())


def ckptd(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptd", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A copy: a restore writes its lease into the store."""
    return Path(shutil.copytree(FIXTURE / "store", tmp_path / "store"))


@pytest.fixture
def configs(tmp_path: Path) -> dict[str, Path]:
    """Per run: the signed run's config names the key it was signed with."""
    key = tmp_path / "manifest.key"
    key.write_bytes((FIXTURE / "manifest.key").read_bytes())
    key.chmod(0o600)
    plain, signed = tmp_path / "plain.toml", tmp_path / "signed.toml"
    plain.write_text("")
    signed.write_text(f'[authentication]\nkey_file = "{key}"\n')
    return {"plain": plain, "signed": signed}


def tree_digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("run", sorted(EXPECTED))
@pytest.mark.parametrize("checkpoint", ["checkpoint-100", "checkpoint-200"])
def test_a_checkpoint_committed_before_the_move_restores_byte_for_byte(
    run: str, checkpoint: str, store: Path, configs: dict[str, Path], tmp_path: Path
) -> None:
    config = configs[run]
    out = tmp_path / "out"
    dest = ("--dest", store.as_uri(), "--run", run)
    done = ckptd(
        "restore",
        *dest,
        "--checkpoint",
        checkpoint,
        "--to",
        str(out),
        "--no-progress",
        config=config,
    )
    assert done.returncode == 0, done.stderr
    assert tree_digests(out / checkpoint) == EXPECTED[run][checkpoint]


@pytest.mark.parametrize("run", sorted(EXPECTED))
def test_latest_verify_and_list_read_the_older_store(
    run: str, store: Path, configs: dict[str, Path]
) -> None:
    config = configs[run]
    dest = ("--dest", store.as_uri(), "--run", run)
    verified = ckptd("verify", *dest, "--latest", "--json", config=config)
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["checkpoint"] == "checkpoint-200"
    listed = ckptd("list", *dest, "--json", config=config)
    assert listed.returncode == 0, listed.stderr
    assert "checkpoint-100" in listed.stdout and "checkpoint-200" in listed.stdout


def test_a_tampered_signed_manifest_from_before_the_move_is_refused(
    store: Path, configs: dict[str, Path]
) -> None:
    config = configs["signed"]
    manifest = store / "signed" / "checkpoint-200" / "ckptd.manifest.json"
    doc = json.loads(manifest.read_text())
    doc["step"] = 201
    manifest.write_text(json.dumps(doc))
    verified = ckptd(
        "verify",
        "--dest",
        store.as_uri(),
        "--run",
        "signed",
        "--checkpoint",
        "checkpoint-200",
        config=config,
    )
    assert verified.returncode == 1, verified.stdout + verified.stderr
