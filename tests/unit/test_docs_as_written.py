"""The docs, tested as written (in process): every configuration snippet in README.md and
docs/*.md passes what ``ckptd config check`` checks, every documented ``CKPTD_*``
variable is one ckptd reads, each with the value the docs give it, and every ``ckptd``
command line the docs show names only flags its command has (the CLI tables included).

The snippets are found (``tests.support.docsnippets``), never listed here; a block marked
``<!-- docs-test: skip (REASON) -->`` is reported as skipped under its name. The
subprocess side (``ckptd config check`` itself, the transcripts, the shell blocks that
run here, one case per exit code) is ``tests/process/test_docs_as_written.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest

from ckptd.cli.parser import build_parser
from ckptd.config import (
    ConfigError,
    load_settings,
    render_effective_config,
    require_destination,
    require_watch,
)
from ckptd.config.environment import env_variable_paths
from tests.support.docsnippets import (
    ROOT,
    SHELL_LANGUAGES,
    Block,
    all_blocks,
    blocks,
    ckptd_argv,
    command_mentions,
    environment_mentions,
    missing_for_a_whole_config,
    shell_lines,
    transcript,
)

BLOCKS = all_blocks()
CONFIGS = [b for b in BLOCKS if b.language == "toml" and b.file is None]
SHELL = [b for b in BLOCKS if b.language in SHELL_LANGUAGES]
# Each ckptd command line of a shell block: (block, its arguments).
SHELL_CKPTD = [
    (b, argv) for b in SHELL for line in shell_lines(b.text) if (argv := ckptd_argv(line))
]
NAMES, ASSIGNMENTS = environment_mentions()
COMMANDS = command_mentions()


def check_config(path: Path, environ: dict[str, str]) -> str:
    """What ``ckptd config check --config PATH`` checks, in process, with only
    ``environ`` for the environment: the effective config it would print, or
    ConfigError. A fragment gets what it lacks as ``--watch``/``--dest`` would."""
    no_watch, no_url = missing_for_a_whole_config(path.read_text())
    flags: dict[str, Any] = {}
    if no_watch:
        flags["watch"] = [{"dir": str(path.parent / "run")}]
    if no_url:
        flags["destination"] = {"url": f"file://{path.parent / 'store'}"}
    settings = load_settings(path, environ=environ, overrides=flags)
    require_destination(settings)
    require_watch(settings)
    return render_effective_config(settings)


def test_the_docs_hold_snippets_of_every_kind() -> None:
    """The finder finds: a change to the fences or markers that hides every snippet
    would otherwise pass all of these tests by testing nothing."""
    assert len(CONFIGS) >= 3 and len(SHELL) >= 5 and len(SHELL_CKPTD) >= 5
    assert len(NAMES) >= 20 and len(ASSIGNMENTS) >= 2 and len(COMMANDS) >= 20


@pytest.mark.parametrize("block", CONFIGS, ids=[b.name for b in CONFIGS])
def test_config_snippet_passes_config_check(block: Block, tmp_path: Path) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.name}: {block.skip}")
    config = tmp_path / "ckptd.toml"
    config.write_text(block.text)
    try:
        shown = check_config(config, dict(block.environment))
    except ConfigError as exc:
        pytest.fail(f"{block.name}: `ckptd config check` refuses it:\n{exc}")
    assert "[destination]" in shown


def _page_config(where: str, tmp_path: Path) -> Path:
    """The config a variable is read beside: the page's own first config snippet (a
    variable in many-nodes.md goes with its [cluster]), else a minimal one."""
    doc = where.rsplit(":", 1)[0]
    config = tmp_path / "base.toml"
    own = [b for b in CONFIGS if b.doc == doc and b.skip is None]
    config.write_text(
        own[0].text
        if own
        else f'[[watch]]\ndir = "{tmp_path / "run"}"\n[destination]\nurl = "file://{tmp_path}/s"\n'
    )
    return config


@pytest.mark.parametrize(
    ("where", "name", "value"), ASSIGNMENTS, ids=[f"{w}:{n}" for w, n, _ in ASSIGNMENTS]
)
def test_environment_override_with_its_documented_value_is_accepted(
    where: str, name: str, value: str, tmp_path: Path
) -> None:
    config = _page_config(where, tmp_path)
    page_env = [dict(b.environment) for b in CONFIGS if b.doc == where.rsplit(":", 1)[0]]
    try:
        settings = load_settings(config, environ={**(page_env[0] if page_env else {}), name: value})
    except ConfigError as exc:
        pytest.fail(f"{where}: {name}={value} is refused:\n{exc}")
    require_destination(settings)


def _names_in_source() -> set[str]:
    """Every ``"CKPTD_..."`` string literal in ckptd/: the variables ckptd sets for the
    trainer or reads itself (CKPTD_RESUME_FROM, CKPTD_URL, ...)."""
    found: set[str] = set()
    for module in (ROOT / "ckptd").rglob("*.py"):
        found |= set(re.findall(r"[\"'](CKPTD_[A-Z0-9_]+)[\"']", module.read_text()))
    return found


def test_every_documented_variable_is_one_ckptd_reads_or_sets() -> None:
    settings_variables = set(env_variable_paths())
    in_source = _names_in_source()
    unknown = sorted(
        {f"{m.where}: {m.text}" for m in NAMES}
        - {f"{m.where}: {m.text}" for m in NAMES if m.text in settings_variables | in_source}
    )
    assert unknown == [], "documented variables that no setting and no code uses"


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    """The parser of ``command`` ("run", "config check"), None if there is none."""
    for word in command.split():
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            return None
        parser = subs[0].choices[word]
    return parser


def test_every_flag_the_docs_give_a_command_is_one_it_has() -> None:
    """The CLI tables (cli.md, design.md), the prose and the shell blocks: a flag a
    command does not have is bad usage (exit 2) for whoever copies it."""
    parser = build_parser()
    wrong = []
    for mention, command, flags in COMMANDS:
        sub = _subparser(parser, command)
        if sub is None:
            wrong.append(f"{mention.where}: no command `ckptd {command}` ({mention.text})")
            continue
        known = set(sub._option_string_actions)
        wrong += [
            f"{mention.where}: `ckptd {command}` has no {flag} ({mention.text})"
            for flag in flags
            if flag not in known
        ]
    assert wrong == []


@pytest.mark.parametrize(
    ("block", "argv"), SHELL_CKPTD, ids=[f"{b.name}:{' '.join(a[:1])}" for b, a in SHELL_CKPTD]
)
def test_each_ckptd_line_of_a_shell_snippet_parses(block: Block, argv: list[str]) -> None:
    """Checked even where the block cannot run here (marked skip): parsing needs no
    cloud, and a flag or argument the parser refuses is exit 2 for whoever copies it."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(
                f"{block.name}: `ckptd {' '.join(argv)}` exits {exc.code}: {err.getvalue()}"
            )


def test_the_finder_reads_markers_transcripts_and_fragments(tmp_path: Path) -> None:
    """The rules of tests.support.docsnippets on a page made for it."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: skip (needs AWS credentials) -->\n\n```sh\nckptd list\n```\n"
        "<!-- docs-test: file bad.toml -->\n```toml\n[destination]\n```\n"
        "<!-- docs-test: env NODE_RANK=2 (the launcher's) -->\n```toml\n[cluster]\n```\n"
        "```text\n$ CKPTD_X=1 ckptd config check\nout\nmore\n$ ckptd -V\nckptd 1\n```\n"
    )
    found = list(blocks(page))
    assert [(b.language, b.skip, b.file, b.environment) for b in found] == [
        ("sh", "needs AWS credentials", None, ()),
        ("toml", None, "bad.toml", ()),
        ("toml", None, None, (("NODE_RANK", "2"),)),
        ("text", None, None, ()),
    ]
    commands = transcript(found[3])
    assert [(c.environment, c.argv, c.output) for c in commands] == [
        ({"CKPTD_X": "1"}, ["ckptd", "config", "check"], "out\nmore"),
        ({}, ["ckptd", "-V"], "ckptd 1"),
    ]
    assert missing_for_a_whole_config("[http]\nlisten = 1\n") == (True, True)
    assert missing_for_a_whole_config('[[watch]]\ndir="/x"\n[destination]\nurl="s3://b/p"') == (
        False,
        False,
    )


def test_a_fragment_with_a_bad_key_is_refused(tmp_path: Path) -> None:
    """A fragment gets a watch dir and a destination, never a pass for its own keys."""
    config = tmp_path / "fragment.toml"
    config.write_text("[destination]\nregion = 'us-east-1'\n")
    assert "[destination]" in check_config(config, {})
    config.write_text("[destination]\nregoin = 'us-east-1'\n")
    with pytest.raises(ConfigError, match=r"destination\.regoin"):
        check_config(config, {})
