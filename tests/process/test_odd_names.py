"""File and directory names a trainer may produce: spaces, non-ASCII (NFC and NFD
spellings of one name are two files), the characters URL and S3 key encodings treat
specially, empty files, deep nesting. Each is shipped, committed, verified and restored
byte-identical, to SeaweedFS and to a file:// directory. A name no store can hold
faithfully (a control character: S3 listings are XML 1.0, which cannot carry most of
them; a backslash, which SeaweedFS turns into '/'; bytes that are not UTF-8) makes the
checkpoint unshippable, said and counted, never silently dropped, and the daemon goes on
shipping the next checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import Daemon, wait_until
from tests.support.writers import local_files

ODD_NAMES = [
    "with space.bin",
    "  leading and trailing  .bin",
    "ünïcødé/日本語.bin",
    unicodedata.normalize("NFC", "café.bin"),
    unicodedata.normalize("NFD", "café.bin"),  # the same to a reader, another file here
    "plus+equals=amp&q?.bin",
    "percent%20not-a-space.bin",
    "hash#frag.bin",
    "tilde~semi;colon,comma.bin",
    "quote'dquote\".bin",
    "brackets[0]{1}(2)<3>.bin",
    "star*pipe|caret^dollar$.bin",
    "emoji 🧠.bin",
    "empty.bin",
    "a/b/c/d/e/f/g/h/deep.bin",
    ".hidden",
    "-leading-dash.bin",
]


def _write(checkpoint: Path) -> None:
    for i, name in enumerate(ODD_NAMES):
        path = checkpoint / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"" if name == "empty.bin" else os.urandom(1000 + i))
    (checkpoint / "COMPLETE").write_text("")


def _ckptd(command: str, config: Path, name: str, *more: str) -> str:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "ckptd", command, "--config", str(config)),
            *("--run", "run", "--checkpoint", name, *more),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(params=["s3", "file"])
def destination(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    if request.param == "file":
        return f"file://{tmp_path / 'store'}", ""
    local_s3: LocalS3 = request.getfixturevalue("local_s3")
    return request.getfixturevalue("s3_dest"), local_s3.endpoint_url


def test_odd_names_ship_verify_and_restore_byte_identical(
    tmp_path: Path, destination: tuple[str, str]
) -> None:
    dest, endpoint = destination
    run = tmp_path / "run"
    run.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": run, "layout": "marker", "settle_seconds": 0}],
        dest=dest,
        endpoint_url=endpoint,
        state_dir=tmp_path / "state",
    )
    with daemon:
        _write(run / "step-3")
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="step-3"),
            60,
            "the checkpoint with odd names committed",
            details=daemon.log_text,
        )
    _ckptd("verify", daemon.config, "step-3")
    out = _ckptd("restore", daemon.config, "step-3", "--to", str(tmp_path / "fresh"), "--json")
    restored = json.loads(out)
    assert restored["files"] == len(ODD_NAMES) + 1
    assert local_files(tmp_path / "fresh" / "step-3") == local_files(run / "step-3")


@pytest.mark.parametrize(
    "bad",
    [b"line\nbreak.bin", b"back\\slash.bin", b"latin1-\xe9.bin", b"tab\there.bin"],
    ids=["newline", "backslash", "not-utf8", "tab"],
)
def test_a_name_no_store_holds_is_unshippable_and_the_next_checkpoint_ships(
    bad: bytes, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    daemon = Daemon.configured(
        tmp_path,
        watch=[{"dir": run, "layout": "marker", "settle_seconds": 0}],
        dest=f"file://{tmp_path / 'store'}",
        state_dir=tmp_path / "state",
    )
    with daemon:
        checkpoint = run / "step-4"
        checkpoint.mkdir()
        with open(os.path.join(os.fsencode(checkpoint), bad), "wb") as fh:
            fh.write(b"x" * 100)
        (checkpoint / "weights.bin").write_bytes(b"y" * 100)
        (checkpoint / "COMPLETE").write_text("")
        (event,) = wait_until(
            lambda: daemon.events_named("checkpoint_has_unshippable_entries", checkpoint="step-4"),
            30,
            "the name refused",
            details=daemon.log_text,
        )
        assert [os.fsencode(e) for e in event["entries"]] == [bad]
        assert daemon.metric("ckptd_unshippable_entries_total", run="run") == 1
        # The worker is not stuck on it: the next checkpoint commits.
        (run / "step-5").mkdir()
        (run / "step-5" / "weights.bin").write_bytes(b"z" * 100)
        (run / "step-5" / "COMPLETE").write_text("")
        wait_until(
            lambda: daemon.events_named("checkpoint_committed", checkpoint="step-5"),
            30,
            "the next checkpoint committed",
            details=daemon.log_text,
        )
        assert not daemon.events_named("checkpoint_committed", checkpoint="step-4")
