"""The package's layers, as docs/design.md's "Layers" section draws them: a module imports only
from its own layer or the ones below, and the pure modules do no I/O and read no clock.

Imports are read from the source (``ast``), function-level ones included, so a lazy
import that runs back up the layers fails here as surely as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ckptd

PACKAGE = Path(ckptd.__file__).parent

# Bottom first. A module belongs to the first entry naming it or a package above it
# (the most specific name wins).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "pure",
        (
            "ckptd",
            "ckptd.core",
            "ckptd.layouts",
            "ckptd.sync.queue",
            "ckptd.sync.plan",
            "ckptd.sync.deadline",
            "ckptd.commit.parts",
            "ckptd.cadence.model",
            "ckptd.supervision.restarts",
            "ckptd.notices.slurm_job",
            "ckptd.supervision.requeue",
            "ckptd.goodput.model",
            "ckptd.drill.model",
            "ckptd.doctor.findings",
            "ckptd.peers.model",
            "ckptd.peers.placement",
            "ckptd.peers.liveness",
            "ckptd.peers.auth",
            "ckptd.health.model",
            "ckptd.health.xid",
            "ckptd.health.kmsg",
            "ckptd.health.memory",
            "ckptd.health.disk",
            "ckptd.health.store",
            "ckptd.health.decide",
            "ckptd.health.gpu",
            "ckptd.health.dcgm",
            "ckptd.health.diskstats",
            "ckptd.health.loss",
        ),
    ),
    (
        "foundation",
        ("ckptd.runtime", "ckptd.config", "ckptd.core.signing", "ckptd.core.saves"),
    ),
    ("storage", ("ckptd.storage",)),
    ("repository", ("ckptd.repository", "ckptd.repository_bodies")),
    ("commit", ("ckptd.commit",)),
    ("read side", ("ckptd.store",)),
    ("peers", ("ckptd.peers",)),
    ("write side", ("ckptd.sync",)),
    (
        "daemon",
        (
            "ckptd.notices",
            "ckptd.health",
            "ckptd.cadence",
            "ckptd.goodput",
            "ckptd.drill",
            "ckptd.daemon",
            "ckptd.supervision",
            "ckptd.doctor",
        ),
    ),
    ("entry points", ("ckptd.cli", "ckptd.__main__", "ckptd.devtools")),
]
# ckptd.trainer runs inside the trainer's process: it stands apart and imports no other
# part of ckptd, so a trainer never pulls in the daemon (boto, aiohttp, watchdog).
TRAINER = "ckptd.trainer"
# ... except the names of the files both sides share (standard library only).
TRAINER_MAY_IMPORT = "ckptd.core.handoff"
# The write side (sync/: the pipeline, and its coordination with other nodes) is reached
# only from the daemon that runs it (its build and tier set; ckptd exec's service, which
# finds where the trainer resumes); everything else, the CLI included, sits below it.
WRITE_SIDE = ("ckptd.sync",)
WRITE_SIDE_IMPORTERS = {
    "ckptd.daemon.build",
    "ckptd.daemon.peering",  # peer replication: its replicator and hand-off ship
    "ckptd.daemon.tier_set",
    "ckptd.supervision.exec_service",
}

PURE_FORBIDDEN = {
    "asyncio",
    "aiohttp",
    "boto3",
    "botocore",
    "socket",
    "sqlite3",
    "subprocess",
    "threading",
    "time",
    "watchdog",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = all_modules()


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (``from ckptd import x`` counts as ckptd.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    found.add(f"{node.module}.{alias.name}")
    return found


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            # "ckptd" itself is the package's __init__, not everything under it.
            matches = module == name or (name != "ckptd" and module.startswith(name + "."))
            if matches and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def test_every_module_has_a_layer() -> None:
    missing = [m for m in MODULES if not m.startswith(TRAINER) and layer_of(m) is None]
    assert missing == [], f"add these to LAYERS (and docs/development.md's drawing): {missing}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith(TRAINER)))
def test_no_import_runs_back_up_the_layers(module: str) -> None:
    own = layer_of(module)
    assert own is not None
    for target in sorted(imports_of(MODULES[module])):
        if not target.startswith("ckptd") or target == "ckptd":
            continue
        assert not target.startswith(TRAINER), f"{module} imports the trainer helper {target}"
        theirs = layer_of(target)
        assert theirs is not None and theirs <= own, (
            f"{module} ({LAYERS[own][0]}) imports {target} "
            f"({'?' if theirs is None else LAYERS[theirs][0]}), a layer above it"
        )
        if target.startswith(WRITE_SIDE) and not module.startswith(WRITE_SIDE):
            assert module in WRITE_SIDE_IMPORTERS, f"{module} reaches into {target}"


def package_of(module: str) -> str:
    """The package a module belongs to: ``ckptd.<first name>`` (``ckptd`` for the root)."""
    return ".".join(module.split(".")[:2])


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of packages (each as the list of packages on it), by a depth-first walk
    from each package: a package reached again while still on the path closes one."""
    cycles: list[list[str]] = []
    seen_cycles: set[frozenset[str]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt) :]
                if frozenset(cycle) not in seen_cycles:
                    seen_cycles.add(frozenset(cycle))
                    cycles.append(cycle)
            elif len(path) < len(graph):
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        own = package_of(module)
        for target in imports_of(path):
            if target.startswith("ckptd.") and package_of(target) != own:
                graph.setdefault(own, set()).add(package_of(target))
    return graph


def test_no_two_packages_import_each_other() -> None:
    # Layers are kept module by module; this keeps them package by package too, as a
    # compiler would (restic's Go packages cannot import each other at all).
    assert package_cycles(package_graph()) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    graph = {"ckptd.a": {"ckptd.b"}, "ckptd.b": {"ckptd.c"}, "ckptd.c": {"ckptd.a"}}
    assert package_cycles(graph) == [["ckptd.a", "ckptd.b", "ckptd.c"]]
    assert package_cycles({"ckptd.a": {"ckptd.b"}, "ckptd.b": set()}) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(TRAINER)))
def test_the_trainer_helper_imports_nothing_of_the_daemon(module: str) -> None:
    for target in imports_of(MODULES[module]):
        if target.startswith("ckptd") and target not in ("ckptd", "ckptd.core"):
            assert target.startswith(TRAINER) or target == TRAINER_MAY_IMPORT, (
                f"{module} imports {target}"
            )


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if not m.startswith(TRAINER) and layer_of(m) == 0)
)
def test_pure_modules_do_no_io_and_read_no_clock(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    roots = {name.split(".")[0] for name in imports_of(MODULES[module])}
    assert not roots & PURE_FORBIDDEN, f"{module} imports {roots & PURE_FORBIDDEN}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("now", "utcnow", "today"):
            pytest.fail(f"{module} reads the clock ({ast.unparse(node)}) at line {node.lineno}")
        if isinstance(node, ast.Name) and node.id == "open":
            pytest.fail(f"{module} opens a file at line {node.lineno}")


def test_the_checker_sees_a_violation() -> None:
    # The rule is only worth its name if it can fail: a module in the storage layer that
    # imported the pipeline would be caught.
    assert layer_of("ckptd.storage.s3") is not None
    assert layer_of("ckptd.sync.pipeline") is not None
    assert layer_of("ckptd.storage.s3") < layer_of("ckptd.sync.pipeline")  # type: ignore[operator]
    assert "ckptd.repository" in imports_of(MODULES["ckptd.store.restore"])
