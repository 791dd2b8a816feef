"""Errors a user meets end as one clean line and the documented exit code, never a traceback.

The real CLI (``python -m ckptd``) against a ``file://`` destination laid out by hand:
a committed checkpoint whose manifest is garbage, one whose manifest names ``../evil``,
and a good one beside them. Also: every error class under ``ckptd/`` derives from
``CkptdError`` unless it is internal control flow named in ``INTERNAL``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import pkgutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ckptd
import ckptd.core.errors
from ckptd import __version__
from ckptd.cli.main import DaemonUnreachableError, UsageError, build_parser, main
from ckptd.commit.single import CommitConflictError
from ckptd.config import ConfigError
from ckptd.core import checksum
from ckptd.core.errors import CkptdError
from ckptd.core.manifest import MANIFEST_NAME, ManifestError, build_manifest
from ckptd.devtools.locals3 import LocalS3
from ckptd.storage.base import StorageError
from ckptd.store.restore import RestoreError
from tests.support.daemon import run_cli

NAME = "checkpoint-1"
GOOD_RUN = "good"
# What each corrupt run's one checkpoint holds as its manifest.
CORRUPT = {
    "garbage": b"{this is not json",
    "evil": json.dumps(
        {
            "format": "ckptd.manifest/1",
            "run_id": "evil",
            "checkpoint": NAME,
            "step": 1,
            "layout": "hf",
            "host": "node-1",
            "created_at": "2024-01-01T00:00:00Z",
            "committed_at": "2024-01-01T00:00:00Z",
            "total_bytes": 5,
            "files": [{"path": "../evil", "size": 5, "crc32c": "00000000"}],
            "environment": {},
        }
    ).encode(),
}

# Exceptions that never reach a user: the pipeline catches them to change course.
INTERNAL = {
    "ckptd.sync.transfer.CheckpointChangedError",  # abandon the checkpoint, rescan later
    "ckptd.sync.transfer.TransferPausedError",  # make way for an emergency checkpoint
    # Slurm's answers the notice source and exec's requeue read: logged, the source goes on.
    "ckptd.notices.slurm.SlurmError",
    "ckptd.notices.slurm_job.SlurmParseError",
    # Peer replication: a peer that failed a range (the restore reads it from the next
    # holder or the store), a replica a hand-off refuses (logged, counted, never sent).
    "ckptd.peers.source.PeerReadError",
    # Bytes on a peer stream that are not a frame: the holder refuses and closes the
    # stream, the sender turns it into a PeerError (the chunk goes again, or over HTTP).
    "ckptd.peers.frames.FrameError",
    "ckptd.sync.handoff.RefusedError",
    # A reply the direct S3 path cannot read: classified as a StorageError where it is met.
    "ckptd.storage.http1.ReplyError",
}


@pytest.fixture()
def dest(tmp_path: Path) -> Path:
    """The store's root: one run per corrupt manifest (LATEST naming it), one good run."""
    root = tmp_path / "store"
    for run, manifest in CORRUPT.items():
        (root / run / NAME).mkdir(parents=True)
        (root / run / NAME / MANIFEST_NAME).write_bytes(manifest)
        (root / run / "evil").write_bytes(b"pwned")  # where <run>/<NAME>/../evil points
        (root / run / "LATEST").write_text(
            json.dumps({"checkpoint": NAME, "step": 1, "manifest_crc32c": "00000000"})
        )
    data = b"hello"
    (root / GOOD_RUN / NAME).mkdir(parents=True)
    (root / GOOD_RUN / NAME / "weights.bin").write_bytes(data)
    good = build_manifest(
        run_id=GOOD_RUN,
        checkpoint=NAME,
        step=1,
        layout="hf",
        host="node-1",
        created_at=0,
        committed_at=0,
        files=[("weights.bin", len(data), checksum.to_hex(checksum.crc32c(data)))],
        environment={},
    )
    (root / GOOD_RUN / NAME / MANIFEST_NAME).write_bytes(good.to_bytes())
    return root


def _clean_failure(result: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a failed command, after checking it is exit 1 and no trace."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptd: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("run", sorted(CORRUPT))
def test_verify_of_a_corrupt_manifest_is_one_line_and_exit_1(dest: Path, run: str) -> None:
    result = run_cli("verify", "--dest", dest.as_uri(), "--run", run, "--checkpoint", NAME)
    line = _clean_failure(result)
    assert "invalid manifest" in line
    assert f"{run}/{NAME}/{MANIFEST_NAME}" in line  # which object is at fault


@pytest.mark.parametrize("run", sorted(CORRUPT))
def test_verify_latest_skips_a_corrupt_manifest_and_says_nothing_is_committed(
    dest: Path, run: str
) -> None:
    result = run_cli("verify", "--dest", dest.as_uri(), "--run", run, "--latest")
    assert "no committed checkpoint" in _clean_failure(result)


@pytest.mark.parametrize("run", sorted(CORRUPT))
def test_restore_of_a_corrupt_manifest_is_refused_and_writes_nothing(
    dest: Path, tmp_path: Path, run: str
) -> None:
    out = tmp_path / "out"
    result = run_cli(
        "restore", "--dest", dest.as_uri(), "--run", run, "--checkpoint", NAME, "--to", str(out)
    )
    line = _clean_failure(result)
    assert line.startswith("ckptd: restore refused: invalid manifest"), line
    assert not (out / NAME).exists()
    assert list(out.glob(f"*{NAME}*")) == []  # no staging directory either
    assert not (out / "evil").exists()


def test_list_skips_corrupt_manifests_and_lists_the_rest(dest: Path) -> None:
    result = run_cli("list", "--dest", dest.as_uri(), "--json")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    rows = json.loads(result.stdout)["checkpoints"]
    assert [(r["run"], r["checkpoint"]) for r in rows] == [(GOOD_RUN, NAME)]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--concurrency", "-1"),
        ("--concurrency", "many"),
        ("--chunk-mib", "0"),
        ("--chunk-mib", "-1"),
        ("--chunk-mib", "many"),
    ],
)
def test_restore_sizes_below_one_are_bad_usage_not_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str, value: str
) -> None:
    argv = ["restore", "--dest", tmp_path.as_uri(), "--run", "r", "--latest"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--to", str(tmp_path / "out"), option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_every_error_a_user_can_meet_derives_from_ckptd_error() -> None:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(ckptd.__path__, "ckptd."):
        if info.name == "ckptd.__main__":  # importing it runs the CLI
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:  # a trainer integration without its framework installed
            if (exc.name or "").startswith("ckptd"):
                raise
            continue
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                found[f"{info.name}.{name}"] = cls
    errors = {k for k in found if k.endswith("Error")}
    assert not INTERNAL - errors, f"stale INTERNAL entries: {INTERNAL - errors}"
    assert {k for k in errors - INTERNAL if not issubclass(found[k], CkptdError)} == set()
    assert {k for k in INTERNAL if issubclass(found[k], CkptdError)} == set()
    for key, cls in found.items():
        if issubclass(cls, CkptdError):
            assert cls.exit_code in (1, 2), key


def test_exit_codes_of_the_error_classes() -> None:
    codes = {
        cls.__name__: cls.exit_code
        for cls in (
            ConfigError,
            UsageError,
            StorageError,
            ManifestError,
            RestoreError,
            CommitConflictError,
            DaemonUnreachableError,
        )
    }
    assert codes == {
        "ConfigError": 2,
        "UsageError": 2,
        "StorageError": 1,
        "ManifestError": 1,
        "RestoreError": 1,
        "CommitConflictError": 1,
        "DaemonUnreachableError": 1,
    }
    assert issubclass(ManifestError, ValueError)  # callers still catch it as one


def test_the_errors_module_imports_nothing_so_every_module_may_import_it() -> None:
    tree = ast.parse(Path(ckptd.core.errors.__file__).read_text())
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "typing"}


def _options(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.option_strings:
            yield path, action


def test_every_option_of_every_command_says_what_it_does() -> None:
    missing = [
        f"{path} {'/'.join(action.option_strings)}"
        for path, action in _options(build_parser(), "ckptd")
        if not action.help
    ]
    assert missing == []


def test_short_version_flag_prints_the_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ckptd", "-V"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert done.stdout.strip() == f"ckptd {__version__}"


def test_config_check_fails_where_run_would(tmp_path: Path) -> None:
    """`config check` passes exactly what `ckptd run` accepts."""
    env = {"CKPTD_METRICS__LISTEN": "127.0.0.1:0"}
    no_dest = tmp_path / "no-dest.toml"
    no_dest.write_text(f'[[watch]]\ndir = "{tmp_path / "run"}"\n')
    no_watch = tmp_path / "no-watch.toml"
    no_watch.write_text(f'[destination]\nurl = "file://{tmp_path / "store"}"\n')
    whole = tmp_path / "whole.toml"
    whole.write_text(no_dest.read_text() + no_watch.read_text())
    for config, key in ((no_dest, "destination.url"), (no_watch, "watch")):
        for command in (["config", "check"], ["run", "--once"]):
            done = run_cli(*command, "--config", str(config), env=env)
            assert done.returncode == 2, (command, done.stderr)
            assert f"invalid config: {key}" in done.stderr, (command, done.stderr)
            assert "Traceback" not in done.stderr
            # Nothing on stdout: a script reading it gets a config run takes, or nothing.
            assert done.stdout == "", (command, done.stdout)
    ok = run_cli("config", "check", "--config", str(whole), env=env)
    assert ok.returncode == 0, ok.stderr
    assert "[destination]" in ok.stdout and "note: no config file" not in ok.stderr
    # The flags run takes override the file here as they do there (docs/configuration.md).
    other = tmp_path / "other-run"
    flagged = run_cli(
        *("config", "check", "--config", str(no_watch)),
        *("--watch", str(other), "--run", "r2", "--state-dir", str(tmp_path / "st")),
        env=env,
    )
    assert flagged.returncode == 0, flagged.stderr
    assert str(other) in flagged.stdout and '"r2"' in flagged.stdout, flagged.stdout
    assert str(tmp_path / "st") in flagged.stdout


def test_status_takes_no_destination_flag_and_drill_only_with_restore_only() -> None:
    """They ask the daemon, never a store: a --dest that did nothing is refused (a drill
    takes one only with --restore-only, which reads the store itself)."""
    for flag in ("--dest", "--endpoint-url"):
        done = run_cli("status", flag, "s3://my-bucket/ckpt")
        assert done.returncode == 2, (flag, done.stderr)
        assert f"unrecognized arguments: {flag}" in done.stderr
        drill = run_cli("drill", flag, "s3://my-bucket/ckpt")
        assert drill.returncode == 2, (flag, drill.stderr)
        (line,) = [ln for ln in drill.stderr.splitlines() if ln.startswith("ckptd: ")]
        assert f"{flag} apply to --restore-only" in line, drill.stderr


def test_a_metrics_port_in_use_is_one_line_naming_the_key(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = run_cli(
            *("run", "--watch", str(tmp_path / "run"), "--dest", f"file://{tmp_path / 's'}"),
            *("--state-dir", str(tmp_path / "state")),
            env={"CKPTD_METRICS__LISTEN": f"127.0.0.1:{port}"},
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if not x.startswith("{")]
    assert "metrics.listen" in line and "in use" in line and "Traceback" not in done.stderr


def test_a_state_dir_that_cannot_be_made_is_one_line_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")  # root may write anywhere, but not under a file
    done = run_cli(
        *("run", "--once", "--watch", str(tmp_path / "run"), "--dest", f"file://{tmp_path / 's'}"),
        *("--state-dir", str(tmp_path / "a-file" / "state")),
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if not x.startswith("{")]
    assert "state.dir" in line and str(tmp_path / "a-file") in line
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("case", "env", "bucket", "words"),
    [
        (
            "wrong key",
            {"AWS_ACCESS_KEY_ID": "nope", "AWS_SECRET_ACCESS_KEY": "nope"},
            "ckpt",
            "denied",
        ),
        ("no bucket", {}, None, "does not exist"),  # None: a bucket no test made
        (
            "no credentials",
            {
                "AWS_ACCESS_KEY_ID": None,
                "AWS_SECRET_ACCESS_KEY": None,
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                "AWS_CONFIG_FILE": "/nonexistent",
                "AWS_EC2_METADATA_DISABLED": "true",
            },
            "ckpt",
            "AWS_ACCESS_KEY_ID",  # says where credentials come from
        ),
    ],
)
@pytest.mark.parametrize("work", [True, False], ids=["a checkpoint to ship", "nothing to ship"])
def test_once_ends_within_seconds_on_a_store_that_refuses_this_node(
    tmp_path: Path,
    local_s3: LocalS3,
    case: str,
    env: dict[str, str | None],
    bucket: str | None,
    words: str,
    work: bool,
    missing_bucket: str,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if work:
        (run / "checkpoint-5").mkdir()
        (run / "checkpoint-5" / "model.bin").write_bytes(b"weights")
    bucket = bucket or missing_bucket
    environ = {**os.environ, **local_s3.env()}
    for key, value in env.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    started = time.monotonic()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "ckptd", "run", "--once", "--layout", "quiescent"),
            *("--watch", str(run), "--dest", f"s3://{bucket}/x"),
            *("--endpoint-url", local_s3.endpoint_url, "--state-dir", str(tmp_path / "state")),
        ],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, (case, done.stderr[-2000:])
    assert took < 20, f"{case}: --once took {took:.1f} s on a permanent error"
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptd: ") and words in last, last
    assert "Traceback" not in done.stderr


def test_a_dead_endpoint_is_retried_aloud_and_bounded_by_max_attempts() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    done = run_cli(
        *("list", "--dest", "s3://ckpt/x", "--endpoint-url", f"http://127.0.0.1:{port}"),
        env={
            "CKPTD_DESTINATION__MAX_ATTEMPTS": "3",
            "AWS_ACCESS_KEY_ID": "a",
            "AWS_SECRET_ACCESS_KEY": "b",
        },
        timeout=120,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    retries = [json.loads(x) for x in done.stderr.splitlines() if '"store_retry"' in x]
    assert [r["attempt"] for r in retries] == ["1/3", "2/3"]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptd: list s3://ckpt/x/: "), last  # the place, never empty
    assert took < 30


def test_restore_off_a_terminal_says_its_result_once(tmp_path: Path) -> None:
    """One human line on stdout; nothing on stderr when all went well (no JSON line
    repeating it); the same with --json gives one document and still a quiet stderr."""
    from ckptd.storage import open_storage
    from tests.integration.test_restore import commit_files

    dest = f"file://{tmp_path / 'shared'}"
    commit_files(open_storage(dest), "run", "ck-3", {"w.bin": os.urandom(3 * 2**20)}, step=3)
    common = ("--dest", dest, "--run", "run", "--latest")
    done = run_cli("restore", *common, "--to", str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    (line,) = done.stdout.splitlines()
    assert line.startswith("restored run/ck-3") and "3.0 MiB" in line
    as_json = run_cli("restore", *common, "--to", str(tmp_path / "b"), "--json")
    assert as_json.returncode == 0 and as_json.stderr == ""
    assert json.loads(as_json.stdout)["checkpoint"] == "ck-3"
    # Asked for, the progress and the summary are logged too.
    verbose = run_cli("restore", *common, "--to", str(tmp_path / "c"), "--log-level", "info")
    assert "restore_done" in verbose.stderr


def test_run_once_with_a_missing_watch_dir_says_so_and_exits_1(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    done = run_cli(
        "run",
        "--once",
        "--watch",
        str(missing),
        "--dest",
        f"file://{tmp_path / 'store'}",
        env={"CKPTD_STATE__DIR": str(tmp_path / "state"), "CKPTD_PREEMPTION__PROVIDER": "none"},
    )
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("ckptd:")]
    assert errors == [
        f"ckptd: watch dir {missing} does not exist: nothing was shipped from it; "
        "create it or fix [[watch]] dir"
    ]
    assert "watch_dir_missing" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "profile"])
def test_an_s3_destination_reaching_google_from_outside_the_config_is_refused(
    tmp_path: Path, variable: str
) -> None:
    """Google Cloud Storage's S3 API ignores the conditional write ckptd commits with: an
    endpoint botocore takes from the environment or the AWS profile is refused as the
    config's own is, one line, exit 2, before anything is shipped."""
    env = {"AWS_EC2_METADATA_DISABLED": "true"}
    if variable == "profile":
        profile = tmp_path / "aws-config"
        profile.write_text("[profile gcs]\nendpoint_url = https://storage.googleapis.com.\n")
        env.update(AWS_CONFIG_FILE=str(profile), AWS_PROFILE="gcs")
    else:
        env[variable] = "https://storage.googleapis.com."
    watch = tmp_path / "run"
    watch.mkdir()
    done = run_cli(
        *("run", "--once", "--watch", str(watch), "--dest", "s3://b-1/x"),
        "--state-dir",
        str(tmp_path / "state"),
        env=env,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("ckptd:")]
    assert len(lines) == 1 and "Google Cloud Storage" in lines[0] and "gs://" in lines[0]
    assert "Traceback" not in done.stderr


def _snapshot(root: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every entry under ``root`` (symlinks not followed): what a restore may not change."""
    found: dict[str, tuple[str, bytes | str]] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = ("link", os.readlink(path))
        elif path.is_file():
            found[key] = ("file", path.read_bytes())
        else:
            found[key] = ("dir", "")
    return found


def _read_only_wrapper(directory: Path) -> list[str]:
    """The argv prefix that runs a command with ``directory`` read-only to it: a
    read-only bind mount in a mount namespace of its own for root (whom modes do not
    stop), mode 0555 for anyone else."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return []
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    wrapper = ["unshare", "--mount", "--", "sh", "-c", script, str(directory)]
    probe = subprocess.run([*wrapper, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here: {probe.stderr.strip()}")
    return wrapper


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("an existing file", "is a file, not a directory"),
        ("a path under a file", "which is a file, not a directory"),
        ("/proc/x", "cannot be made here"),
        ("a read-only directory", "read-only filesystem"),
        ("a dangling symlink", "which does not exist: create that directory"),
    ],
)
def test_restore_into_an_odd_target_is_one_line_naming_it_and_writes_nothing(
    tmp_path: Path, case: str, words: str
) -> None:
    from ckptd.storage import open_storage
    from tests.integration.test_restore import commit_files

    dest = f"file://{tmp_path / 'store'}"
    commit_files(open_storage(dest), "run", "ck-3", {"w.bin": b"weights"}, step=3)
    here = tmp_path / "here"
    here.mkdir()
    (here / "a-file").write_bytes(b"mine")
    (here / "link").symlink_to(here / "nowhere")
    (here / "ro").mkdir()
    prefix: list[str] = []
    to = {
        "an existing file": here / "a-file",
        "a path under a file": here / "a-file" / "sub",
        "/proc/x": Path("/proc/x"),
        "a read-only directory": here / "ro",
        "a dangling symlink": here / "link",
    }[case]
    if case == "a read-only directory":
        prefix = _read_only_wrapper(here / "ro")
    before = _snapshot(here)
    restore = ["restore", "--dest", dest, "--run", "run", "--latest", "--to", str(to)]
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "ckptd", *restore],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = _clean_failure(done)
    assert line.startswith(f"ckptd: restore failed: {to} "), line
    assert words in line and "name a directory" in line, line  # the thing, and the fix
    assert _snapshot(here) == before  # nothing written, the link's target not made
    assert not Path("/proc/x").exists()


def test_a_refused_restore_is_one_line_naming_the_files_at_fault(tmp_path: Path) -> None:
    from ckptd.storage import open_storage
    from tests.integration.test_restore import commit_files

    store = tmp_path / "store"
    commit_files(open_storage(f"file://{store}"), "run", "ck-3", {"w.bin": b"weights"}, step=3)
    (store / "run" / "ck-3" / "w.bin").write_bytes(b"short")  # the store's copy no longer fits
    out = tmp_path / "out"
    done = run_cli(
        *("restore", "--dest", f"file://{store}", "--run", "run", "--latest", "--to", str(out))
    )
    line = _clean_failure(done)
    assert "1 object(s) do not match the manifest; nothing was written" in line, line
    assert "(w.bin: object is 5 bytes, smaller than the manifest's 7)" in line, line
    assert not (out / "ck-3").exists()


def test_report_takes_the_run_as_every_command_does_and_the_old_form_still_works(
    tmp_path: Path,
) -> None:
    dest = ("--dest", f"file://{tmp_path / 'store'}")
    (tmp_path / "store" / "run3").mkdir(parents=True)
    new = run_cli("report", *dest, "--run", "run3", "--json")
    assert new.returncode == 0 and new.stderr == "", new.stderr
    assert json.loads(new.stdout)["run"] == "run3"
    old = run_cli("report", *dest, "run3", "--json")
    assert old.returncode == 0, old.stderr
    assert old.stdout == new.stdout
    assert old.stderr.strip() == (
        "ckptd: note: 'ckptd report RUN' is deprecated: use 'ckptd report --run run3'"
    )
    bad = run_cli("report", *dest, "--run", "run3", "run4")
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == (
        "ckptd: error: --run run3 and RUN run4 name different runs"
    )


def test_restore_if_any_is_a_no_op_on_a_run_with_nothing_committed_and_fails_on_a_bad_store(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str, missing_bucket: str
) -> None:
    """What the pod's restore step relies on: exit 0 and nothing written when the run has
    nothing committed (on SeaweedFS and on file://); exit 1 when the store cannot be
    read (no such bucket, a dead endpoint, a file:// root that is not there)."""
    to = tmp_path / "out"
    argv = ("restore", "--run", "run1", "--latest", "--if-any", "--to", str(to))
    s3 = ("--endpoint-url", local_s3.endpoint_url)
    (tmp_path / "empty-store").mkdir()
    for dest in (("--dest", s3_dest, *s3), ("--dest", f"file://{tmp_path / 'empty-store'}")):
        done = run_cli(*argv, *dest)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout == (
            "nothing  run 'run1' has no committed checkpoint yet: nothing to restore\n"
        )
        assert not to.exists()
    as_json = json.loads(run_cli(*argv, *dest, "--json").stdout)
    assert as_json == {"run": "run1", "checkpoint": None, "nothing_committed": True}
    for dest, words in (
        (("--dest", f"s3://{missing_bucket}/x", *s3), "does not exist"),
        (("--dest", f"file://{tmp_path / 'not-mounted'}"), "not a directory"),
    ):
        done = run_cli(*argv, *dest, env={"CKPTD_DESTINATION__MAX_ATTEMPTS": "1"})
        line = _clean_failure(done)
        assert words in line, line
        assert done.stdout == "" and not to.exists()
    # A run with a commit is restored as without the flag.
    from ckptd.storage import open_storage
    from tests.integration.test_restore import commit_files

    commit_files(open_storage(f"file://{tmp_path / 'empty-store'}"), "run1", "ck-1", {"w": b"1"})
    done = run_cli(*argv, "--dest", f"file://{tmp_path / 'empty-store'}")
    assert done.returncode == 0 and (to / "ck-1" / "w").read_bytes() == b"1", done.stderr


def test_if_any_without_latest_is_bad_usage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import structlog

    saved = structlog.get_config()  # main configures structlog for the process
    try:
        code = main(
            ["restore", "--run", "r", "--checkpoint", "ck-1", "--if-any", "--to", str(tmp_path)]
        )
    finally:
        structlog.configure(**saved)
    assert code == 2
    assert "ckptd: error: --if-any goes with --latest" in capsys.readouterr().err


def test_restore_of_a_run_id_not_in_the_store_names_the_runs_that_are(
    dest: Path, tmp_path: Path
) -> None:
    """A typo'd --run reads as nothing committed: the one line names what is there."""
    result = run_cli(
        "restore", "--dest", dest.as_uri(), "--run", "god", "--latest", "--to", str(tmp_path / "o")
    )
    line = _clean_failure(result)
    assert "run 'god' has no committed checkpoint" in line, line
    assert "holds run(s) evil, garbage, good" in line and "did you mean 'good'?" in line, line
    assert not (tmp_path / "o").exists()


def test_restore_from_a_typod_prefix_names_the_prefix_beside_it(dest: Path, tmp_path: Path) -> None:
    """A typo'd --dest holds no run at all: the prefix one level up is listed once and the
    entries close to the asked name are named."""
    typo = dest.parent / "stor"
    result = run_cli(
        "restore",
        "--dest",
        typo.as_uri(),
        "--run",
        GOOD_RUN,
        "--latest",
        "--to",
        str(tmp_path / "o"),
    )
    line = _clean_failure(result)
    assert f"file://{typo} holds no run; beside it: file://{dest}" in line, line
