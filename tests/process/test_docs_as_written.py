"""The docs, tested as written (as processes): ``ckptd config check`` itself on every
configuration snippet of README.md and docs/*.md, every transcript (``$ ckptd ...`` and
the output the page shows) run and compared, every shell block not marked skip run, and one case per exit code of
the exit-code tables. (README's `make demo`, skipped here, is ``test_demo.py``.)

The in-process side (the same configs, every ``CKPTD_*`` variable, every flag against
the parser) is ``tests/unit/test_docs_as_written.py``; the finder and the markers are
``tests.support.docsnippets``. Skipped blocks are pytest skips named by page and line,
with the reason the page gives (``-rs`` lists them).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptd.cli.errors import EXIT_INTERRUPTED
from ckptd.core.errors import EXIT_FLUSH_FAILED, EXIT_GAVE_UP
from tests.support.daemon import wait_until
from tests.support.docsnippets import (
    ROOT,
    SHELL_LANGUAGES,
    Block,
    all_blocks,
    exit_code_tables,
    is_transcript,
    missing_for_a_whole_config,
    transcript,
)

BLOCKS = all_blocks()
CONFIGS = [b for b in BLOCKS if b.language == "toml" and b.file is None]
TRANSCRIPTS = [b for b in BLOCKS if is_transcript(b)]
SHELL = [b for b in BLOCKS if b.language in SHELL_LANGUAGES]
CKPTD = [sys.executable, "-m", "ckptd"]


def clean_environment(**more: str) -> dict[str, str]:
    """This process's environment without any ``CKPTD_*`` (the docs' commands see only
    what they set), ckptd importable from this checkout, and ``more``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **more}


def test_config_check_passes_every_config_snippet(tmp_path: Path) -> None:
    """The real command, one process per snippet, all at once."""
    runnable = [b for b in CONFIGS if b.skip is None]
    assert runnable, "no config snippet found"
    running = []
    for i, block in enumerate(runnable):
        config = tmp_path / f"{i}.toml"
        config.write_text(block.text)
        no_watch, no_url = missing_for_a_whole_config(block.text)
        fragment = [
            *(["--watch", str(tmp_path / "run")] if no_watch else []),
            *(["--dest", f"file://{tmp_path / 'store'}"] if no_url else []),
        ]
        running.append(
            (
                block,
                subprocess.Popen(
                    [*CKPTD, "config", "check", "--config", str(config), *fragment],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=clean_environment(**dict(block.environment)),
                ),
            )
        )
    for block, proc in running:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (
            f"{block.name}: `ckptd config check` exits {proc.returncode}: {err}"
        )
        assert "[destination]" in out, block.name


@pytest.mark.parametrize("block", TRANSCRIPTS, ids=[b.name for b in TRANSCRIPTS])
def test_transcript_gives_the_output_the_page_shows(block: Block, tmp_path: Path) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.name}: {block.skip}")
    for other in BLOCKS:  # the files the page names (<!-- docs-test: file NAME -->)
        if other.doc == block.doc and other.file is not None:
            (tmp_path / other.file).write_text(other.text + "\n")
    for command in transcript(block):
        assert command.argv[:1] == ["ckptd"], f"{block.name}: runs only ckptd commands"
        done = subprocess.run(
            [*CKPTD, *command.argv[1:]],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=clean_environment(**command.environment),
            timeout=120,
        )
        shown = (done.stdout + done.stderr).rstrip("\n")
        assert shown == command.output, f"{block.name}: `{' '.join(command.argv)}`"


@pytest.mark.parametrize("block", SHELL, ids=[b.name for b in SHELL])
def test_shell_snippet_runs(block: Block, tmp_path: Path) -> None:
    """A shell block runs here unless marked skip, with the reason, in its page."""
    if block.skip is not None:
        pytest.skip(f"{block.name}: {block.skip}")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_environment(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"),
        timeout=120,
    )
    assert done.returncode == 0, f"{block.name}:\n{done.stdout}\n{done.stderr}"


# -- one case per exit code --------------------------------------------------------------


def _dead_port() -> int:
    with socket.socket() as probe:  # nothing listens on it once closed
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _valid_config(tmp: Path) -> Path:
    config = tmp / "ok.toml"
    config.write_text(f'[[watch]]\ndir = "{tmp / "run"}"\n[destination]\nurl = "file://{tmp}/s"\n')
    return config


def _start(tmp: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """``ckptd ARGS`` in ``tmp``, its output (stdout and stderr) in ``tmp/out.log``."""
    with open(tmp / "out.log", "w") as out:
        return subprocess.Popen(
            [*CKPTD, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp,
            env=clean_environment(CKPTD_METRICS__LISTEN="127.0.0.1:0", **env),
            # As from a terminal: a suite started in the background (``cmd &`` in a
            # script) has SIGINT ignored, and a child inherits that, so Ctrl-C's case
            # could not be made.
            preexec_fn=_sigint_as_from_a_terminal,
        )


def _sigint_as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _said(tmp: Path, event: str) -> Callable[[], bool]:
    return lambda: f'"event": "{event}"' in (tmp / "out.log").read_text()


def _exec(tmp: Path, trainer: str, *more: str) -> subprocess.Popen[str]:
    return _start(
        tmp,
        *("exec", "--watch", str(tmp / "run"), "--dest", f"file://{tmp}/s"),
        *("--state-dir", str(tmp / "state"), *more, "--", sys.executable, "-c", trainer),
    )


def _signalled(proc: subprocess.Popen[str], sig: int, after: Callable[[], bool]) -> None:
    wait_until(after, 60, "the process to get going")
    proc.send_signal(sig)


def _code_0(tmp: Path) -> subprocess.Popen[str]:
    return _start(tmp, "config", "check", "--config", str(_valid_config(tmp)))


def _code_1(tmp: Path) -> subprocess.Popen[str]:
    return _start(tmp, "status", "--url", f"http://127.0.0.1:{_dead_port()}")


def _code_2(tmp: Path) -> subprocess.Popen[str]:
    bad = tmp / "bad.toml"
    bad.write_text("[destination]\npart_size_mib = 1\n")
    return _start(tmp, "config", "check", "--config", str(bad))


def _code_75(tmp: Path) -> subprocess.Popen[str]:
    # Preempted (SIGTERM) while the trainer never saves: nothing to commit.
    proc = _exec(tmp, "import time; time.sleep(120)", "--shutdown-timeout", "5")
    _signalled(proc, signal.SIGTERM, _said(tmp, "trainer_started"))
    return proc


def _code_76(tmp: Path) -> subprocess.Popen[str]:
    return _exec(tmp, "import sys; sys.exit(3)")  # fails at start-up: given up on


def _code_130(tmp: Path) -> subprocess.Popen[str]:
    # A one-shot command waiting on a dead endpoint, interrupted by Ctrl-C.
    proc = _start(
        tmp,
        *("list", "--dest", "s3://my-bucket/ckpt"),
        *("--endpoint-url", f"http://127.0.0.1:{_dead_port()}"),
        AWS_ACCESS_KEY_ID="docs",
        AWS_SECRET_ACCESS_KEY="docs",
    )
    _signalled(proc, signal.SIGINT, _said(tmp, "store_retry"))
    return proc


CASES: dict[int, Callable[[Path], subprocess.Popen[str]]] = {
    0: _code_0,
    1: _code_1,
    2: _code_2,
    EXIT_FLUSH_FAILED: _code_75,
    EXIT_GAVE_UP: _code_76,
    EXIT_INTERRUPTED: _code_130,
}


def test_every_documented_exit_code_is_produced_by_a_case(tmp_path: Path) -> None:
    """Each code of every `| code | meaning |` table (cli.md, design.md, exec.md), made
    to happen: the cases run at once, and none may be missing."""
    documented = exit_code_tables()
    codes = sorted({code for _, code, _ in documented})
    missing = [f"{where}: {code}" for where, code, _ in documented if code not in CASES]
    assert missing == [], "add a case for these exit codes"
    started = time.monotonic()
    running = {}
    for code in codes:
        (tmp_path / str(code)).mkdir()
        running[code] = CASES[code](tmp_path / str(code))
    got = {}
    for code, proc in running.items():
        try:
            proc.wait(timeout=max(1.0, 120 - (time.monotonic() - started)))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        got[code] = proc.returncode
    logs = {c: (tmp_path / str(c) / "out.log").read_text()[-1500:] for c in codes if got[c] != c}
    assert got == {c: c for c in codes}, logs
