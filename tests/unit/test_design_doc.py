"""docs/design.md says what the code does: its sections, names, keys, formats and layers.

The code cites the design by section ("docs/design.md, "HTTP""): every section cited
exists. The keys, format names, file names, module names and metric names the document
quotes are the code's, and its "Layers" table is ``tests/unit/test_layers.py``'s
``LAYERS``, row for row. (The recipes are proven in ``test_design_recipes.py``.)
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from ckptd import repository as repo
from ckptd.cadence.model import HISTORY_FORMAT
from ckptd.commit import parts as protocol
from ckptd.core import errors, handoff, manifest, names, signing
from ckptd.goodput.model import FORMAT as GOODPUT_FORMAT
from ckptd.runtime import instance
from ckptd.runtime.metrics import Metrics
from tests.unit.test_design_recipes import ROOT, design_text, section
from tests.unit.test_docs_links import anchors_of
from tests.unit.test_layers import LAYERS, PURE_FORBIDDEN, TRAINER_MAY_IMPORT

# The sections the code cites, and those the design must have whatever cites them.
REQUIRED = (
    "Remote layout and manifest",
    "Many nodes, one checkpoint",
    "HTTP",
    "CLI",
    "Supervised training",
    "Trainer signalling",
    "Checkpoint cadence advice",
    "Layers",
)


# These files quote citations as examples.
OWN_FILES = ("test_design_doc.py", "test_design_recipes.py")


def headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.*)$", design_text(), flags=re.M)}


def citations() -> dict[str, set[str]]:
    """Every ``docs/design.md "Section"`` citation in the code, tests and other docs:
    section -> the files citing it. A citation may run over a line break (a docstring or
    a comment) and name several sections (``"HTTP"; "Checkpoint cadence advice"``)."""
    files = [*ROOT.joinpath("ckptd").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]
    files += [ROOT / "README.md", *ROOT.joinpath("docs").glob("*.md")]
    found: dict[str, set[str]] = {}
    for path in files:
        if not path.exists() or path.name in ("design.md", *OWN_FILES):
            continue
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(encoding="utf-8"))
        # design.md "X", design.md, "X", design.md's "X", [design.md](design.md), "X"
        pattern = r'design\.md\)?(?:\'s)?,?\s+((?:"[^"]+"[;,]?\s*)+)'
        for cited in re.finditer(pattern, text):
            for title in re.findall(r'"([^"]+)"', cited.group(1)):
                found.setdefault(title, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_section_the_code_cites_exists() -> None:
    cited = citations()
    assert {"HTTP", "CLI", "Layers"} <= set(cited), "the citation finder finds citations"
    missing = {title: sorted(where) for title, where in cited.items() if title not in headings()}
    assert missing == {}, f"docs/design.md lacks the sections these files cite: {missing}"


@pytest.mark.parametrize("title", REQUIRED)
def test_the_design_has_the_section(title: str) -> None:
    assert title in headings()


def test_the_pure_layers_forbidden_imports_are_test_layers() -> None:
    for name in PURE_FORBIDDEN:
        assert f"`{name}`" in section("Layers"), name


def test_the_layers_table_is_test_layers_LAYERS() -> None:
    rows = re.findall(r"^\| ([a-z ]+?) \| (`.*`) \|$", section("Layers"), flags=re.M)
    documented = [(name, tuple(re.findall(r"`([^`]+)`", modules))) for name, modules in rows]
    assert documented == LAYERS


def test_every_key_is_spelled_as_the_repository_spells_it() -> None:
    keys = section("Keys (contract)")
    run, name = "<run>", "<checkpoint>"
    spelled = [
        repo.object_key(run, name, "<path>"),
        repo.manifest_key(run, name),
        repo.latest_key(run),
        repo.notice_key(run),
        repo.cadence_key(run),
        f"{repo.lease_prefix(run)}{name}-<uuid>",
        repo.announce_key(run, name),
        f"{repo.checkpoint_prefix(run, name)}{names.PART_PREFIX}<rank>{names.PART_SUFFIX}",
    ]
    for key in spelled:
        assert re.search(rf"^{re.escape(key)}\s", keys, flags=re.M), f"{key} is not in Keys"


def test_every_format_name_is_the_codes() -> None:
    text = design_text()
    for name in (
        manifest.FORMAT,
        protocol.ANNOUNCE_FORMAT,
        protocol.PART_FORMAT,
        repo.NOTICE_FORMAT,
        HISTORY_FORMAT,
        GOODPUT_FORMAT,
    ):
        assert f"`{name}`" in text, name
    assert repr(manifest.SIGNATURE_DOMAIN).replace("'", '"') in section("Signature")
    assert f"the {len(manifest.SIGNATURE_DOMAIN)} bytes" in section("Signature")
    assert f"at least {signing.MIN_KEY_BYTES} bytes" in section("Signature")
    assert f"younger than {repo.LEASE_TTL_SECONDS:.0f} s" in section(
        "Objects and their write order"
    )


def test_the_cluster_numbers_are_the_codes() -> None:
    roles = section("Roles")
    assert f"{protocol.CLOCK_SKEW_SECONDS:.0f} s for `dcp` and `megatron`" in roles
    assert sorted(protocol.RECORD_AFTER_EVERY_RANK) == ["dcp", "megatron"]
    assert f"{protocol.SAVE_TAIL_SECONDS:.0f} s for the others" in roles
    assert f"more than {protocol.ABANDON_GRACE_SECONDS:.0f} s old" in section(
        "Giving up and the sweep"
    )


def test_the_exit_codes_are_the_codes() -> None:
    cli = section("CLI")
    for code, name in (
        (errors.EXIT_FAILED, "EXIT_FAILED"),
        (errors.EXIT_USAGE, "EXIT_USAGE"),
        (errors.EXIT_FLUSH_FAILED, "EXIT_FLUSH_FAILED"),
        (errors.EXIT_GAVE_UP, "EXIT_GAVE_UP"),
    ):
        assert re.search(rf"^\| {code} \| .*`{name}`", cli, flags=re.M), name
    supervised = section("Supervised training")
    assert f"**{errors.EXIT_FLUSH_FAILED}** (`EXIT_FLUSH_FAILED`)" in supervised
    assert f"**{errors.EXIT_GAVE_UP}** (`EXIT_GAVE_UP`)" in supervised


def test_the_trainer_files_are_the_ones_both_sides_use() -> None:
    files = section("Trainer signalling")
    for relpath in (
        handoff.NOTICE,
        handoff.ADVICE,
        handoff.SAVES,
        handoff.STEP_COUNTER,
        handoff.STEPS,
        handoff.RESTORED,
        handoff.DAEMON_LOCK,
    ):
        assert relpath.parent == handoff.DIR == Path(".ckptd")
        assert f"| `{relpath.name}` |" in files, relpath
    assert "`ckptd.core.handoff`" in files
    assert f"but `{TRAINER_MAY_IMPORT}`" in section("Layers")
    assert f"`<state dir>/{instance.STATE_LOCK}`" in section("Local state")


def test_the_step_counter_layout_is_the_codes() -> None:
    ledger, layout = section("Run ledger (contract)"), handoff.STEP_LAYOUT
    assert f"`<watch dir>/{handoff.STEP_COUNTER}`" in ledger
    assert f"little-endian, {layout.SIZE} bytes" in ledger
    assert f"| 0 | 8 | magic `{layout.MAGIC.decode()}` |" in ledger
    assert f"| 8 | 4 | format, u32: {layout.FORMAT} |" in ledger
    assert f"| 12 | 4 | slot size, u32: {layout.SLOT_SIZE} |" in ledger
    for index in (0, 1):
        assert f"| {layout.slot(index)} | {layout.SLOT_SIZE} | slot {index}:" in ledger
    assert f"two {layout.RECORD.size}-byte records" in ledger


def test_the_ledger_numbers_are_the_codes() -> None:
    from ckptd.goodput.model import ABANDONED_SECONDS, MARKS

    ledger = section("Run ledger (contract)")
    assert f"its last record is {ABANDONED_SECONDS:.0f} s old (`ABANDONED_SECONDS`" in ledger
    for kind in MARKS:
        assert f"`{kind}`" in ledger, kind


def test_every_metric_named_is_exported() -> None:
    exported: set[str] = set()
    for family in Metrics().registry.collect():
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    named = set(re.findall(r"\bckptd_[a-z0-9_]+\b", design_text()))
    assert named, "the design names metrics"
    assert named - exported == set()


def is_module(dotted: str) -> bool:
    """Whether ``ckptd.a.b`` is a module or package of the source tree (found, not
    imported: ``ckptd.__main__`` runs the CLI when imported)."""
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def resolves(dotted: str) -> bool:
    """Whether ``ckptd.a.b.c`` is a module, or an attribute of the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        if not is_module(".".join(parts[:cut])):
            continue
        if cut == len(parts):
            return True
        obj: object = importlib.import_module(".".join(parts[:cut]))
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_named_exists() -> None:
    named = set(re.findall(r"`(ckptd(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", design_text()))
    named |= set(re.findall(r"\((ckptd(?:\.[A-Za-z_][A-Za-z0-9_]*)+)\)", design_text()))
    assert len(named) > 20
    assert sorted(n for n in named if not resolves(n)) == []
    for path in re.findall(r"`((?:tests|ckptd)/[A-Za-z0-9_/]+\.py)`", design_text()):
        assert Path(ROOT, path).exists(), path


def test_every_anchor_in_the_design_leads_to_a_section() -> None:
    anchors = set(re.findall(r"\]\(#([^)]+)\)", design_text()))
    assert anchors, "the design links its own sections"
    assert anchors - anchors_of(design_text()) == set()
