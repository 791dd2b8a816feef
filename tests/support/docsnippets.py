"""The runnable parts of the documentation, found in README.md and docs/*.md as written.

What counts (docs/development.md, "The docs, tested as written"):

- a fenced ``toml`` block is a configuration: ``config check`` must pass it (a
  fragment, short of ``[[watch]]`` or ``[destination] url``, with those given as flags);
- a fenced ``sh``/``shell``/``bash`` block is commands: each ``ckptd`` line must parse;
- a fenced ``text``/``console`` block whose first line starts with ``$ `` is a
  transcript: each ``$ `` line is run, and what follows it, up to the next ``$ ``, is
  its output (stdout and stderr together);
- ``CKPTD_*`` names in code spans and shell blocks are environment overrides (a
  ``NAME=value`` or ``NAME='value'`` is run with its value);
- every ``ckptd COMMAND ...`` in a code span (the CLI tables, the prose) names only
  flags that command has;
- the ``| code | meaning |`` tables list the exit codes.

An HTML comment on the line before a fence (blank lines between allowed) steers it:
``<!-- docs-test: skip (REASON) -->`` skips the block, by name, with the reason (cloud
credentials, Kubernetes, a machine's service manager); ``<!-- docs-test: file NAME -->``
makes the block the content of the file NAME that the page's transcripts use, not a
snippet of its own; ``<!-- docs-test: env NAME=VALUE (REASON) -->`` checks a config
snippet with that variable set, as the page says it is where the snippet is used (a
launcher's node rank). Pure: reads files, runs nothing.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|file|env)\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
SHELL_LANGUAGES = {"sh", "shell", "bash"}
TRANSCRIPT_LANGUAGES = {"text", "console"}
CODE_SPAN = re.compile(r"(?<!`)`((?:[^`\n]|\n(?!\s*\n))+)`(?!`)")
ENV_ASSIGNMENT = re.compile(r"\b(CKPTD_[A-Z0-9_]+)=('[^']*'|\"[^\"]*\"|[^\s`'\"]+)")
ENV_NAME = re.compile(r"\bCKPTD_[A-Z0-9_]*[A-Z0-9]\b")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (the fence's line), its language and text."""

    doc: str  # path from the repository root
    line: int
    language: str
    text: str
    skip: str | None = None  # the reason, when marked skip
    file: str | None = None  # the file name, when marked file
    environment: tuple[tuple[str, str], ...] = ()  # when marked env

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One ``$ `` line of a transcript and the output the page shows for it."""

    block: Block
    environment: dict[str, str]
    argv: list[str]
    output: str


def documents() -> list[Path]:
    """README.md and every page under docs/ (found, never listed by hand)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def blocks(path: Path) -> Iterator[Block]:
    """Every fenced block of one page, with the marker before it, if any."""
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        marker = _marker_before(lines, i)
        kind, value = marker if marker else (None, None)
        env = ()
        if kind == "env" and value:
            name, _, rest = value.partition("=")
            env = ((name, rest.split()[0] if rest.split() else ""),)
        indent = len(opened.group(1))
        text = "\n".join(line[indent:] for line in lines[i + 1 : end])
        yield Block(
            _relative(path),
            i + 1,
            opened.group(2),
            text,
            skip=value if kind == "skip" else None,
            file=value if kind == "file" else None,
            environment=env,
        )
        i = end + 1


def _marker_before(lines: list[str], fence: int) -> tuple[str, str] | None:
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    found = MARKER.search(lines[j]) if j >= 0 else None
    if found is None:
        return None
    return found.group(1), found.group(2).strip().removeprefix("(").removesuffix(")")


def missing_for_a_whole_config(toml_text: str) -> tuple[bool, bool]:
    """``(no [[watch]], no destination url)`` of a config block. A block short of either
    is a *fragment* (one section shown on its own): it is checked with a watch dir and a
    destination added (``config check --watch DIR --dest URL``), never anything else."""
    import tomllib

    data = tomllib.loads(toml_text)
    destination = data.get("destination")
    has_url = isinstance(destination, dict) and "url" in destination
    return "watch" not in data, not has_url


def all_blocks() -> list[Block]:
    return [b for doc in documents() for b in blocks(doc)]


def code_spans(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every inline code span outside fenced blocks. A span may run
    over a line ending (not a blank line), read as a space, as Markdown renders it."""
    lines = path.read_text().split("\n")
    inside = False
    for i, line in enumerate(lines):  # fenced blocks blanked, line numbers kept
        fence = bool(FENCE.match(line) or re.match(r"^\s*```\s*$", line))
        if fence or inside:
            lines[i] = ""
        if fence:
            inside = not inside
    text = "\n".join(lines)
    for span in CODE_SPAN.finditer(text):
        yield text.count("\n", 0, span.start()) + 1, span.group(1).replace("\n", " ")


def shell_lines(text: str) -> list[str]:
    """A shell block's command lines: continuations joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.split("\n"):
        command = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if command:
            out.append(command)
    return out


def ckptd_argv(command: str) -> list[str] | None:
    """The arguments after ``ckptd`` of a shell command line (variables left as
    written), or None when the line does not run ckptd."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words.pop(0)  # VAR=value before the command
    if not words or words[0] != "ckptd":
        return None
    return words[1:]


def transcript(block: Block) -> list[Command]:
    """A transcript block's commands and the output shown for each."""
    commands: list[Command] = []
    for chunk in re.split(r"^\$ ", block.text, flags=re.MULTILINE)[1:]:
        first, _, output = chunk.partition("\n")
        words = shlex.split(first)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        commands.append(Command(block, env, words, output.rstrip("\n")))
    return commands


def is_transcript(block: Block) -> bool:
    return block.language in TRANSCRIPT_LANGUAGES and block.text.startswith("$ ")


@dataclass(frozen=True)
class Mention:
    """A piece of the docs that names something: where, and what."""

    where: str  # doc:line
    text: str


def environment_mentions() -> tuple[list[Mention], list[tuple[str, str, str]]]:
    """Every ``CKPTD_*`` name in code spans and shell blocks, and every ``NAME=value``
    (``(where, name, value)``), outside transcripts (those run as a whole)."""
    names: list[Mention] = []
    assignments: list[tuple[str, str, str]] = []

    def take(where: str, text: str) -> None:
        for name in ENV_NAME.findall(text):
            names.append(Mention(where, name))
        for name, value in ENV_ASSIGNMENT.findall(text):
            if "$" in value:
                continue  # a shell expansion ($SLURM_JOB_NUM_NODES): only the name is checked
            assignments.append((where, name, _unquoted(value)))

    for doc in documents():
        for line, span in code_spans(doc):
            take(f"{_relative(doc)}:{line}", span)
        for block in blocks(doc):
            if block.language in SHELL_LANGUAGES:
                take(block.name, block.text)
    return names, assignments


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def command_mentions() -> list[tuple[Mention, str, list[str]]]:
    """Every ``ckptd COMMAND [SUBCOMMAND] ...`` in a code span or a shell block:
    ``(where, the command path joined by spaces, the flags it names)``."""
    found: list[tuple[Mention, str, list[str]]] = []

    def take(where: str, text: str) -> None:
        for start in re.finditer(
            r"(?<![\w/.-])ckptd (?!ckptd )([a-z]+)(?: (check))?(?![\w/.-])", text
        ):
            rest = text[start.end() :]
            # Up to the trainer's command (`-- CMD`) or the next ckptd on the line.
            rest = re.split(r"(?:^|\s)--(?:\s|$)|(?<![\w/.-])ckptd ", rest, maxsplit=1)[0]
            command = start.group(1) + (f" {start.group(2)}" if start.group(2) else "")
            found.append((Mention(where, text), command, FLAG.findall(rest)))

    for doc in documents():
        for line, span in code_spans(doc):
            take(f"{_relative(doc)}:{line}", span)
        for block in blocks(doc):
            if block.language in SHELL_LANGUAGES:
                for command in shell_lines(block.text):
                    take(block.name, command)
    return found


def exit_code_tables() -> list[tuple[str, int, str]]:
    """``(doc:line, code, meaning)`` of every row of a ``| code | meaning |`` table."""
    rows: list[tuple[str, int, str]] = []
    for doc in documents():
        in_table = False
        for number, line in enumerate(doc.read_text().split("\n"), start=1):
            if re.match(r"^\|\s*code\s*\|\s*meaning\s*\|", line):
                in_table = True
                continue
            if in_table:
                row = re.match(r"^\|\s*(\d+)\s*\|\s*(.*?)\s*\|\s*$", line)
                if row:
                    rows.append((f"{_relative(doc)}:{number}", int(row.group(1)), row.group(2)))
                elif not line.startswith("|"):
                    in_table = False
    return rows


def how_each_is_tested(block: Block) -> str:
    """What the docs tests do with ``block``: ``skipped`` (marked, with its reason),
    ``config`` (``config check``), ``file`` (written for another block), ``transcript``
    (run, output compared), ``shell`` (run), or ``read``: Python, JSON, YAML, layouts and
    diagrams, not run (the ``ckptd`` commands, flags and ``CKPTD_*`` names anywhere on a
    page are checked in process, and the deploy files the YAML shows are tested whole)."""
    if block.skip is not None:
        return "skipped"
    if block.language == "toml":
        return "config" if block.file is None else "file"
    if block.file is not None:
        return "file"
    if is_transcript(block):
        return "transcript"
    if block.language in SHELL_LANGUAGES:
        return "shell"
    return "read"


def summary() -> list[str]:
    """The docs tests' tally, for the end of a pytest run: how many blocks each way, and
    every skipped one by page, line and reason."""
    found = all_blocks()
    kinds: dict[str, list[Block]] = {}
    for block in found:
        kinds.setdefault(how_each_is_tested(block), []).append(block)
    order = ("config", "transcript", "shell", "file", "read", "skipped")
    counts = ", ".join(f"{len(kinds.get(k, []))} {k}" for k in order)
    lines = [f"{len(found)} fenced blocks in {len(documents())} pages: {counts}"]
    lines += [f"  skipped {b.name}: {b.skip}" for b in kinds.get("skipped", [])]
    return lines
