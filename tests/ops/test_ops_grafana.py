"""The Grafana dashboard: a valid JSON model whose every query names real ckptd metrics."""

from __future__ import annotations

import json
import re
from typing import Any

from prometheus_client.metrics_core import Metric

from ckptd.runtime.metrics import Metrics
from tests.support.ops import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "ckptd-dashboard.json"
METRIC_NAME = re.compile(r"\bckptd_[a-z0-9_]+\b")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
}
# What the issue asks the dashboard to show (docs/design.md "HTTP" names).
REQUIRED = {
    "ckptd_sync_lag_seconds",
    "ckptd_upload_bytes_total",
    "ckptd_checkpoints_committed_total",
    "ckptd_checkpoints_failed_total",
    "ckptd_preemption_notice",
    "ckptd_pending_checkpoints",
    "ckptd_last_committed_step",
}


def exported_names() -> set[str]:
    """Every sample name ckptd can export, labelled series or not."""
    families: list[Metric] = list(Metrics().registry.collect())
    return {f"{f.name}{suffix}" for f in families for suffix in SUFFIXES[f.type]}


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return out


def exprs(doc: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(doc) for t in p.get("targets", [])]


def test_dashboard_is_a_grafana_model_with_a_datasource_variable() -> None:
    doc = dashboard()
    assert 36 <= doc["schemaVersion"] <= 41
    assert doc["uid"] and doc["title"] and doc["id"] is None
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    for p in panels(doc):
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]


def test_every_query_names_an_exported_ckptd_metric() -> None:
    names = exported_names()
    doc = dashboard()
    queries = exprs(doc) + [
        v["definition"] for v in doc["templating"]["list"] if v.get("definition")
    ]
    used: set[str] = set()
    for expr in queries:
        found = set(METRIC_NAME.findall(expr))
        assert found, f"no ckptd metric in {expr!r}"
        assert found <= names, f"unknown metric(s) {found - names} in {expr!r}"
        used |= found
    assert used >= REQUIRED, REQUIRED - used


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
