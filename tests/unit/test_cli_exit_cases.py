"""Every exit code docs/cli.md promises for a command is a test that makes it happen.

The command table's last column (``| command | does | exit |``) says which codes each
command exits with, and the Exit codes table below it adds a drill that failed at a
stage (1). ``CASES`` names, for each documented (command, code) pair, the test that runs that
command and asserts that code; this file checks that the documented pairs and ``CASES``
are the same set (a code documented without a case, or a case for a code no longer
documented, fails here) and that each named test is a function defined at module level of
its file (read with ``ast``, nothing imported). It does not run those tests, nor read
their bodies: they run in the same suite, and that each really runs its command and
asserts its code was checked by hand when it was named here. The cases that can run in
process (``report`` and ``prune`` on a store that cannot be read) are in this file.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from ckptd.cli.main import main
from tests.support.docsnippets import exit_code_tables

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli.md"
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
# Where a case may live: the kinds that run the real command, and this file.
CASE_HOMES = ("tests/process/", "tests/ops/", "tests/e2e/", "tests/integration/", THIS)

# | `ckptd config check [--config FILE] ...` | does | 0 ok, 2 invalid |
COMMAND_ROW = re.compile(r"^\|\s*`ckptd (?P<usage>[^`]*)`\s*\|.*\|\s*(?P<exit>[^|]*?)\s*\|\s*$")
# What the Exit codes table says of one command that its row in the command table does not.
EXIT_TABLE_MENTIONS = {"a drill that failed at a stage": "drill"}

CASES: dict[tuple[str, int], str] = {
    ("run", 0): "tests/process/test_sigterm_meaning.py::"
    "test_under_systemd_a_restart_leaves_the_trainer_training_and_a_shutdown_saves",
    ("run", 1): "tests/process/test_cli_errors.py::"
    "test_run_once_with_a_missing_watch_dir_says_so_and_exits_1",
    ("list", 0): "tests/process/test_cli_errors.py::"
    "test_list_skips_corrupt_manifests_and_lists_the_rest",
    ("list", 1): "tests/process/test_cli_errors.py::"
    "test_a_dead_endpoint_is_retried_aloud_and_bounded_by_max_attempts",
    ("verify", 0): "tests/integration/test_restore_older_store.py::"
    "test_latest_verify_and_list_read_the_older_store",
    ("verify", 1): "tests/integration/test_authentication.py::"
    "test_object_forged_with_same_size_and_crc32c_is_refused",
    ("restore", 0): "tests/process/test_daemon_retention_restore.py::"
    "test_restore_command_is_byte_identical_and_if_missing_is_a_fast_no_op",
    ("restore", 1): "tests/process/test_cli_errors.py::"
    "test_restore_of_a_corrupt_manifest_is_refused_and_writes_nothing",
    ("check", 0): "tests/process/test_store_housekeeping.py::"
    "test_check_names_what_differs_and_what_is_on_one_side_only",
    ("check", 1): "tests/process/test_store_housekeeping.py::"
    "test_check_names_what_differs_and_what_is_on_one_side_only",
    ("prune", 0): "tests/process/test_store_housekeeping.py::"
    "test_prune_is_dry_until_yes_then_deletes_exactly_what_it_said",
    ("prune", 1): f"{THIS}::test_prune_exits_1_when_the_store_cannot_be_read",
    ("rm", 0): "tests/process/test_store_housekeeping.py::"
    "test_rm_refuses_latest_without_force_and_moves_latest_to_the_newest_that_stays",
    ("rm", 1): "tests/process/test_store_housekeeping.py::"
    "test_rm_refuses_latest_without_force_and_moves_latest_to_the_newest_that_stays",
    ("report", 0): "tests/process/test_goodput.py::test_the_ledger_matches_what_the_trainer_did",
    ("report", 1): f"{THIS}::test_report_exits_1_when_the_store_cannot_be_read",
    ("status", 0): "tests/ops/test_ops_statusview.py::test_ckptd_status_prints_the_rich_table",
    ("status", 1): "tests/ops/test_ops_surfaces.py::"
    "test_token_file_guards_the_control_api_and_never_shows",
    (
        "drill",
        0,
    ): "tests/e2e/test_preemption_e2e.py::test_drill_reports_timings_and_commits_in_time",
    ("drill", 1): "tests/ops/test_ops_surfaces.py::"
    "test_a_drill_with_no_trainer_says_none_was_signalled",
    (
        "config check",
        0,
    ): "tests/process/test_cli_errors.py::test_config_check_fails_where_run_would",
    (
        "config check",
        2,
    ): "tests/process/test_cli_errors.py::test_config_check_fails_where_run_would",
    ("doctor", 0): "tests/process/test_doctor.py::"
    "test_doctor_on_seaweedfs_is_all_ok_and_leaves_nothing_in_the_store",
    ("doctor", 1): "tests/process/test_doctor.py::"
    "test_doctor_on_a_missing_bucket_fails_with_the_fix_and_exits_1",
    ("doctor", 2): "tests/process/test_doctor.py::"
    "test_doctor_with_an_invalid_config_exits_2_naming_the_key",
    ("exec", 0): "tests/process/test_exec.py::"
    "test_sigterm_commits_the_emergency_checkpoint_and_a_fresh_node_resumes_there",
    ("exec", 75): "tests/process/test_exec.py::test_sigterm_with_the_store_unreachable_exits_75",
    ("exec", 76): "tests/process/test_exec.py::"
    "test_a_trainer_failing_at_start_up_is_given_up_after_3_attempts",
}


def command_of(usage: str) -> str:
    """``config check [--config FILE] ...`` -> ``config check``: the words before the
    first option or argument."""
    words = []
    for word in usage.split():
        if not re.fullmatch(r"[a-z]+", word):
            break
        words.append(word)
    return " ".join(words)


def codes_of(exit_cell: str) -> set[int]:
    """``0 ok, 1 mismatch (files named)`` -> {0, 1}: the number each clause starts with
    (``CMD``'s own has none; numbers in parentheses, ``about 13 s``, are no codes)."""
    plain = re.sub(r"\([^)]*\)", "", exit_cell)
    return {
        int(m.group(1))
        for clause in re.split(r"[;,]", plain)
        if (m := re.match(r"\s*(\d+)\b", clause))
    }


def documented() -> set[tuple[str, int]]:
    """The (command, code) pairs of the page: its command table, and the Exit codes rows
    (read as the docs tests read every ``| code | meaning |`` table) that name a command
    (``EXIT_TABLE_MENTIONS``)."""
    pairs: set[tuple[str, int]] = set()
    for line in PAGE.read_text().splitlines():
        if row := COMMAND_ROW.match(line):
            command = command_of(row["usage"])
            assert command, f"no command in {line!r}"
            pairs |= {(command, code) for code in codes_of(row["exit"])}
    page = PAGE.relative_to(ROOT).as_posix()
    meanings = {
        code: meaning for where, code, meaning in exit_code_tables() if where.startswith(f"{page}:")
    }
    for phrase, command in EXIT_TABLE_MENTIONS.items():
        codes = [code for code, meaning in meanings.items() if phrase in meaning]
        assert codes, f"no exit code row of {PAGE.name} says {phrase!r} any more"
        pairs |= {(command, code) for code in codes}
    return pairs


def test_the_parser_reads_the_tables_as_meant() -> None:
    assert command_of("config check [--config FILE] [--watch DIR --dest URL]") == "config check"
    assert command_of("report --dest URL --run RUN [--html FILE] [--json]") == "report"
    assert codes_of(
        "0; 1 if the store cannot be read (a dead endpoint: about 13 s, at most 25 s)"
    ) == {0, 1}
    assert codes_of(
        "`CMD`'s own; 0 after a clean preemption flush; 75 flush failed; 76 gave up"
    ) == {0, 75, 76}


def test_every_documented_exit_code_of_a_command_has_a_case() -> None:
    pairs = documented()
    assert pairs, f"no command table found in {PAGE}"
    missing = sorted(pairs - set(CASES))
    stale = sorted(set(CASES) - pairs)
    assert missing == [], f"documented in {PAGE.name} but no test named in CASES: {missing}"
    assert stale == [], f"in CASES but no longer documented in {PAGE.name}: {stale}"


@pytest.mark.parametrize("node_id", sorted(set(CASES.values())))
def test_each_case_is_a_test_function_of_its_file(node_id: str) -> None:
    path, _, name = node_id.partition("::")
    assert path.startswith(CASE_HOMES), f"{node_id}: not a kind that runs the real command"
    assert name.startswith("test_") and "[" not in name, node_id
    source = ROOT / path
    assert source.is_file(), f"{node_id}: no file {path}"
    defined = {
        node.name
        for node in ast.parse(source.read_text(), filename=path).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    assert name in defined, f"{node_id}: {path} defines no test function {name}"


@pytest.fixture
def structlog_as_it_was() -> Iterator[None]:
    """``main`` configures structlog for the process (onto this test's captured stderr):
    put back what was there."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _under_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``--config`` and ``--dest`` of a file:// destination under a regular file, so no
    store is there to read."""
    for name in [k for k in os.environ if k.startswith("CKPTD_")]:
        monkeypatch.delenv(name)
    (tmp_path / "a-file").write_bytes(b"")
    config = tmp_path / "empty.toml"  # not /etc/ckptd/ckptd.toml, whatever this host holds
    config.write_text("")
    return ["--config", str(config), "--dest", (tmp_path / "a-file" / "store").as_uri()]


@pytest.mark.usefixtures("structlog_as_it_was")
def test_report_exits_1_when_the_store_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real command in process: one line on stderr saying so, exit 1, nothing on
    stdout."""
    code = main(["report", *_under_a_file(tmp_path, monkeypatch), "--run", "run-1"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert out == ""
    lines = [line for line in err.splitlines() if line.startswith("ckptd: ")]
    assert len(lines) == 1 and "cannot read run 'run-1'" in lines[0], err
    assert "Traceback" not in err


@pytest.mark.usefixtures("structlog_as_it_was")
def test_prune_exits_1_when_the_store_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As report: one line naming what could not be read, exit 1, nothing on stdout."""
    code = main(["prune", *_under_a_file(tmp_path, monkeypatch), "--yes"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert out == ""
    assert err.splitlines() == [f"ckptd: list {tmp_path / 'a-file' / 'store'}: Not a directory"]
