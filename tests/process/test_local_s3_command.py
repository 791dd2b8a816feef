"""``make s3`` (``python -m ckptd.devtools.locals3``): a new user's own local S3. It prints
the endpoint and the exports to paste; with them, ``ckptd`` ships and lists a checkpoint;
Ctrl-C stops it, exit 0, and its port is free again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.daemon import run_cli


def _read_until(process: subprocess.Popen[str], marker: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} within {timeout} s: {lines}")


def test_make_s3_prints_working_exports_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "ckptd.devtools.locals3", "--dir", str(tmp_path / "s3")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = _read_until(process, "Ctrl-C stops it.", timeout=120)
        exports = dict(
            line.strip().removeprefix("export ").split("=", 1)
            for line in lines
            if line.strip().startswith("export ")
        )
        endpoint = exports["AWS_ENDPOINT_URL"]
        assert endpoint.startswith("http://127.0.0.1:")
        watch = tmp_path / "ckpt" / "run1"
        (watch / "checkpoint-10").mkdir(parents=True)
        (watch / "checkpoint-10" / "model.bin").write_bytes(os.urandom(4096))
        (watch / "checkpoint-10" / "COMPLETE").write_text("")
        env = {**exports, "CKPTD_STATE__DIR": str(tmp_path / "state")}
        dest = ("--dest", "s3://ckpt/try")
        shipped = run_cli(
            "run", "--once", "--watch", str(watch), "--layout", "marker", *dest, env=env
        )
        assert shipped.returncode == 0, shipped.stderr
        listed = run_cli("list", *dest, env=env)
        assert listed.returncode == 0, listed.stderr
        assert "checkpoint-10" in listed.stdout
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert out.strip().endswith("stopped")
    port = int(endpoint.rsplit(":", 1)[1])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # nothing answers there any more
