"""``ckptd exec`` on a node that kept its own part of a many-node checkpoint (a survivor of
a reclaim, restarted in place): the committed whole replaces the part, byte for byte; a
directory under that name holding anything else is never touched and the trainer is not
started (the fleet campaign, #48, saw the survivor exit 1 on its own part; node 0's part, complete by the local rule, would have
been handed to the trainer as it was)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.devtools.locals3 import free_port
from ckptd.storage import open_storage
from tests.integration.test_restore import commit_files
from tests.process.test_tiers import RUN, write_tier_config


def exec_once(tmp_path: Path, watch: Path, store: Path) -> subprocess.CompletedProcess[str]:
    config = write_tier_config(
        tmp_path / "ckptd.toml",
        watch=watch,
        state=tmp_path / "state",
        port=free_port(),
        first={"url": f"file://{store}"},
        retention={"keep_last": 0},
        tiers=[],
    )
    script = "import json, os; json.dump(os.environ.get('CKPTD_RESUME_FROM'), open('r.json', 'w'))"
    trainer = [sys.executable, "-c", script]
    return subprocess.run(
        [sys.executable, "-m", "ckptd", "exec", "--config", str(config), "--", *trainer],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "kept", ["own-part", "own-part-complete-here", "other-bytes", "extra-file"]
)
def test_exec_completes_its_own_part_and_never_touches_anything_else(
    tmp_path: Path, kept: str
) -> None:
    watch, store = tmp_path / "watch", tmp_path / "store"
    whole = {
        "__0_0.distcp": os.urandom(70_000),
        "__1_0.distcp": os.urandom(60_000),
        "COMPLETE": b"",
    }
    commit_files(open_storage(f"file://{store}"), RUN, "step-76", whole, step=76)
    part = watch / "step-76"
    part.mkdir(parents=True)
    (part / "__1_0.distcp").write_bytes(
        whole["__1_0.distcp"] if kept != "other-bytes" else os.urandom(60_000)
    )
    if kept == "extra-file":
        (part / "notes.txt").write_text("mine")
    if kept == "own-part-complete-here":
        # Complete by the local rule (its marker), as node 0's part of a many-node DCP
        # checkpoint is (its shards and .metadata), yet not the whole.
        (part / "COMPLETE").write_bytes(b"")
    before = {p.name: p.read_bytes() for p in part.iterdir()}

    done = exec_once(tmp_path, watch, store)

    if kept.startswith("own-part"):
        assert done.returncode == 0, done.stderr
        assert json.loads((tmp_path / "r.json").read_text()) == str(part)
        assert {p.name: p.read_bytes() for p in part.iterdir()} == whole
        assert [p.name for p in watch.iterdir() if p.name.startswith(".ckptd-part")] == []
        assert "exec_restore_completes_a_part" in done.stderr
    else:
        assert done.returncode == 1, done.stderr
        assert "already exists and differs" in done.stderr
        assert not (tmp_path / "r.json").exists()  # the trainer never started
        assert {p.name: p.read_bytes() for p in part.iterdir()} == before
