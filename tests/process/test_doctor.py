"""``ckptd doctor`` as a user runs it: the real command against the session's SeaweedFS.

All ok on a working setup (and nothing left in the store), a missing bucket failing with
its fix (exit 1), an invalid config exiting 2 naming the key."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import run_cli, wait_until


def write_config(tmp_path: Path, dest: str, endpoint: str, **extra: str) -> Path:
    watch = tmp_path / "run1"
    watch.mkdir(exist_ok=True)
    config = tmp_path / "ckptd.toml"
    config.write_text(
        f'[[watch]]\ndir = "{watch}"\n'
        f'[destination]\nurl = "{dest}"\nendpoint_url = "{endpoint}"\n'
        '[preemption]\nprovider = "none"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n' + "".join(extra.values())
    )
    return config


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[str]:
    """A process that handles SIGUSR1, as a trainer with ckptd.trainer.install() does;
    yields the marker on its command line (trainer.match)."""
    marker = f"doctor-train-{uuid.uuid4().hex[:8]}.py"
    ready = tmp_path / "trainer-ready"
    script = (
        "import pathlib, signal, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: None)\n"
        f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, marker])
    try:
        wait_until(ready.exists, 30, "the trainer to start")
        yield marker
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_doctor_on_seaweedfs_is_all_ok_and_leaves_nothing_in_the_store(
    tmp_path: Path,
    local_s3: LocalS3,
    s3_dest: str,
    s3_prefix: str,
    s3_client: Any,
    trainer: str,
) -> None:
    token = tmp_path / "token"
    token.write_text("a-token\n")
    token.chmod(0o600)
    config = write_config(
        tmp_path,
        s3_dest,
        local_s3.endpoint_url,
        trainer=f'[trainer]\nmatch = "{trainer}"\n',
        http=f'[http]\ntoken_file = "{token}"\n',
    )
    result = run_cli("doctor", "--json", config=config)
    assert result.returncode == 0, result.stdout + result.stderr
    findings = json.loads(result.stdout)["findings"]
    checks = [f["check"] for f in findings]
    assert checks == [
        "config",
        *("credentials", "destination", "checksums", "clock", "create-only"),
        *("metadata", "slurm", "trainer", "disk", "disk", "token", "control"),
    ]
    assert [f for f in findings if f["status"] != "ok"] == []
    assert json.loads(result.stdout)["ok"] is True
    listed = s3_client.list_objects_v2(Bucket="ckpt", Prefix=f"{s3_prefix}/")
    assert listed.get("KeyCount", 0) == 0, listed.get("Contents")  # the probes deleted
    text = run_cli("doctor", config=config)
    assert text.returncode == 0 and text.stderr == ""
    lines = text.stdout.splitlines()
    assert len(lines) == len(findings) and all(line.startswith("ok    ") for line in lines)


def test_doctor_on_a_missing_bucket_fails_with_the_fix_and_exits_1(
    tmp_path: Path, local_s3: LocalS3, missing_bucket: str
) -> None:
    config = write_config(tmp_path, f"s3://{missing_bucket}/p", local_s3.endpoint_url)
    result = run_cli("doctor", config=config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("fail")]
    assert line.startswith(f"fail  destination  bucket '{missing_bucket}' does not exist"), line
    assert line.endswith(
        f"; fix: create it (aws s3 mb s3://{missing_bucket}) or correct destination.url"
    )
    skipped = [ln.split()[1] for ln in result.stdout.splitlines() if ln.startswith("skip")]
    assert skipped == ["checksums", "clock", "create-only"]


def test_doctor_with_an_invalid_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = write_config(tmp_path, "s3://ckpt/p", "", cadence="[cadence]\nmtbf_hours = -1\n")
    result = run_cli("doctor", config=config)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("ckptd: invalid config: cadence.mtbf_hours"), result.stderr
    assert len(result.stderr.splitlines()) == 1
