"""``make s3`` (``python -m ckptd.devtools.locals3``): a new user's own local S3. It prints
the endpoint and the exports to paste; with them, ``ckptd`` ships and lists a checkpoint;
Ctrl-C stops it, exit 0, and its port is free again."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from tests.support.daemon import run_cli
from tests.support.own_s3 import own_s3


def test_make_s3_prints_working_exports_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    with own_s3(tmp_path / "s3") as s3:
        endpoint = s3.endpoint_url
        assert endpoint.startswith("http://127.0.0.1:")
        watch = tmp_path / "ckpt" / "run1"
        (watch / "checkpoint-10").mkdir(parents=True)
        (watch / "checkpoint-10" / "model.bin").write_bytes(os.urandom(4096))
        (watch / "checkpoint-10" / "COMPLETE").write_text("")
        env = {**s3.exports, "CKPTD_STATE__DIR": str(tmp_path / "state")}
        dest = ("--dest", "s3://ckpt/try")
        shipped = run_cli(
            "run", "--once", "--watch", str(watch), "--layout", "marker", *dest, env=env
        )
        assert shipped.returncode == 0, shipped.stderr
        listed = run_cli("list", *dest, env=env)
        assert listed.returncode == 0, listed.stderr
        assert "checkpoint-10" in listed.stdout
    assert s3.process.returncode == 0
    assert s3.said_at_stop.strip().endswith("stopped")
    port = int(endpoint.rsplit(":", 1)[1])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # nothing answers there any more
