"""The metric table in docs/operations.md is ckptd/runtime/metrics.py, row for row: name,
type, labels and help text.

And every ``ckptd_*`` name README.md, the pages under docs/ and the Prometheus rules mention
is one ckptd exports (the Grafana dashboard has its own check, tests/ops/test_ops_grafana.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest
from prometheus_client.metrics import MetricWrapperBase

from ckptd.runtime.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
TABLE_PAGE = ROOT / "docs" / "operations.md"
# Every page a reader may meet a metric's name on.
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PROMETHEUS = ROOT / "deploy" / "prometheus"
# | `ckptd_name{label,label}` | type | help |
ROW = re.compile(
    r"^\|\s*`(?P<name>ckptd_[a-z0-9_]+)(?:\{(?P<labels>[a-z0-9_,]*)\})?`\s*"
    r"\|\s*(?P<type>[a-z]+)\s*\|\s*(?P<help>.*?)\s*\|\s*$"
)
METRIC_NAME = re.compile(r"\bckptd_[a-z0-9_]+\b")
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


class Documented(NamedTuple):
    """One metric as a user sees it: the exported name (``_total`` on counters)."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str


def exported() -> dict[str, Documented]:
    """Every metric family ``Metrics`` registers, by its exported name."""
    metrics = Metrics()
    # Label names are not in a family without samples; the wrapper objects hold them.
    labels = {
        w._name: tuple(w._labelnames)
        for w in vars(metrics).values()
        if isinstance(w, MetricWrapperBase)
    }
    out: dict[str, Documented] = {}
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = Documented(name, family.type, labels[family.name], family.documentation)
    return out


def documented() -> dict[str, Documented]:
    """docs/operations.md's metric table, by name; a name twice is a failure."""
    out: dict[str, Documented] = {}
    for line in TABLE_PAGE.read_text().splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        labels = tuple(m["labels"].split(",")) if m["labels"] else ()
        assert m["name"] not in out, f"docs/operations.md lists {m['name']} twice"
        out[m["name"]] = Documented(m["name"], m["type"], labels, m["help"])
    return out


def sample_names() -> set[str]:
    """Every series name a scrape of ckptd can show."""
    return {
        f"{family.name}{suffix}"
        for family in Metrics().registry.collect()
        for suffix in SAMPLE_SUFFIXES[family.type]
    }


def test_the_docs_table_lists_exactly_the_exported_metrics() -> None:
    code, docs = exported(), documented()
    assert len(docs) > 10, "docs/operations.md's metric table not found"
    assert sorted(code.keys() - docs.keys()) == [], "exported but missing from the docs"
    assert sorted(docs.keys() - code.keys()) == [], "in the docs but not exported"


def test_the_docs_table_rows_match_type_labels_and_help_text() -> None:
    code, docs = exported(), documented()
    differ = {
        name: {"code": code[name], "docs": docs[name]}
        for name in code.keys() & docs.keys()
        if code[name] != docs[name]
    }
    assert differ == {}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_name_the_docs_mention_is_exported(page: Path) -> None:
    # Prose may name a histogram by its family, as the table does.
    known = sample_names() | exported().keys()
    assert set(METRIC_NAME.findall(page.read_text())) - known == set()


@pytest.mark.parametrize(
    "path", sorted(PROMETHEUS.glob("*.yml")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_series_the_prometheus_rules_query_is_exported(path: Path) -> None:
    assert set(METRIC_NAME.findall(path.read_text())) - sample_names() == set()
