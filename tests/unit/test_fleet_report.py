"""The fleet campaign's report (``bench/_fleet_report.py``): a markdown row per policy
and per interruption, and a timeline whose lanes and markers are in the HTML."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench._fleet_figures import PolicyFigures, campaign_figures, load_campaign
from bench._fleet_report import (
    campaign_trace,
    lane,
    policy_table,
    report_markdown,
    timeline_html,
    write,
)
from bench._fleet_trace import smoke_trace
from tests.unit.test_fleet_figures import ckptd_run, uninterrupted


def _figures(root: Path) -> list[PolicyFigures]:
    uninterrupted(root)
    ckptd_run(root)
    return list(campaign_figures(load_campaign(root)).values())


def test_the_markdown_has_a_row_per_policy_and_per_interruption(tmp_path: Path) -> None:
    figures = _figures(tmp_path)
    table = policy_table(figures).splitlines()
    assert len(table) == 2 + 2
    assert table[2].startswith("| uninterrupted | 1.000 | 1.000 | 9.5 | 0.0 | 10 | 0 |")
    assert table[3].startswith(
        "| ckptd | 0.514 | 0.646 | 18.5 | 3.8 | 10 | 2 | 0 | 2 | — | 2.0 / 2.0 | 100 % | yes |"
    )
    trace = smoke_trace(1)
    notice, kill = trace.events
    text = report_markdown(trace, figures, "2 cores, test")
    assert "scale 0.05" in text and "an AWS notice gives 6 s" in text and "2 cores, test" in text
    assert "| ckptd | 2 | kill | — | 1 | 7 | 5 | 5 | 2 | 2.0 | yes |" in text
    assert f"| 1 | {notice.at:.1f} | notice | {notice.provider} | 0 | {notice.window:.1f} |" in text
    assert f"| 2 | {kill.at:.1f} | kill | — | {kill.nodes[0]} | 0.0 |" in text


def test_the_timeline_draws_a_lane_per_node_per_policy_and_marks_notices_and_kills(
    tmp_path: Path,
) -> None:
    html = timeline_html(smoke_trace(1), _figures(tmp_path))
    for name in (lane("uninterrupted", 0), lane("uninterrupted", 1), lane("ckptd", 1)):
        assert json.dumps(name) in html  # plotly writes the lanes as JSON
    names = {json.loads(f'"{n}"') for n in re.findall(r'"name":"((?:[^"\\]|\\.)*)"', html)}
    states = {"stepping", "lost (done again)", "down / replacing", "restoring / starting"}
    assert states <= names
    assert {"notice aws", "kill", "replaced"} <= names
    assert "notice gcp" not in names


def test_write_reads_the_campaign_and_leaves_report_timeline_and_figures_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uninterrupted(tmp_path)
    ckptd_run(tmp_path)
    trace = smoke_trace(4)
    (tmp_path / "trace.json").write_text(trace.to_json())
    doc = write(tmp_path, ["uninterrupted", "ckptd"], machine="test box")
    assert doc["ckptd"]["goodput"] == pytest.approx(9.5 / 18.5)
    assert doc["ckptd"]["lost_steps_by_kind"] == {"notice": (0,), "kill": (2,), "reclaim": ()}
    assert json.loads((tmp_path / "figures.json").read_text())["ckptd"]["steps"] == 10
    assert "test box" in (tmp_path / "report.md").read_text()
    assert json.dumps(lane("ckptd", 0)) in (tmp_path / "timeline.html").read_text()
    assert "| ckptd | 0.514 |" in capsys.readouterr().out
    # Without trace.json, the trace comes back from campaign.json's seed, scale and events.
    (tmp_path / "trace.json").unlink()
    campaign = {"seed": 4, "nodes": 2, "scale": trace.scale}
    events = [e.__dict__ for e in trace.events]
    (tmp_path / "campaign.json").write_text(json.dumps({**campaign, "events": events}))
    again = campaign_trace(tmp_path)
    assert again.events == trace.events and again.duration == max(
        e.replaced_at for e in trace.events
    )
