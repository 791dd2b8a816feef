"""The house's size limits, so that a newcomer can read any part in one sitting: no module
over 600 lines, no class over 400, no function over 80 except declarative tables (the metric
list). A failure names the offender and its size."""

from __future__ import annotations

import ast
from pathlib import Path

import ckptd

PACKAGE = Path(ckptd.__file__).parent
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80
# Declarative tables: one entry per line, nothing to follow but the list itself.
TABLES = {"runtime/metrics.py: Metrics.__init__"}


def oversized(path: Path, source: str) -> list[str]:
    """Every part of ``source`` over its limit, as 'file: Name (N lines, limit L)'."""
    rel = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name
    found: list[str] = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{rel} ({lines} lines, limit {MAX_MODULE_LINES})")

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                if size > limit and f"{rel}: {name}" not in TABLES:
                    found.append(f"{rel}: {name} ({size} lines, limit {limit})")
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_module_class_or_function_is_over_its_limit() -> None:
    offenders = [o for p in sorted(PACKAGE.rglob("*.py")) for o in oversized(p, p.read_text())]
    assert offenders == [], "split these: " + "; ".join(offenders)


def test_the_tables_excepted_still_exist() -> None:
    # An exception for a table that is gone (or renamed) would excuse the next long function.
    for entry in TABLES:
        file, name = entry.split(": ")
        tree = ast.parse((PACKAGE / file).read_text())
        names = {
            f"{cls.name}.{fn.name}"
            for cls in ast.walk(tree)
            if isinstance(cls, ast.ClassDef)
            for fn in cls.body
            if isinstance(fn, ast.FunctionDef)
        }
        assert name in names, f"{entry} is excepted but does not exist"


def test_the_checker_names_an_offender() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"class Small:\n    def long(self) -> None:\n{body}\n"
    assert oversized(PACKAGE / "example.py", source) == [
        f"example.py: Small.long ({MAX_FUNCTION_LINES + 1} lines, limit {MAX_FUNCTION_LINES})"
    ]
