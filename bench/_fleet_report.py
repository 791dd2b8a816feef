"""The fleet campaign's report: markdown tables as docs/benchmarks.md writes them (the
trace, one row per policy, one row per interruption) and the timeline, one self-contained
HTML page drawn with plotly as ``ckptd report`` draws a run (its colours and markers).

The tables and the timeline read no file and no clock: the trace and the figures are
arguments, the text is the result. ``write`` alone touches the disk: it reads a campaign's
directory and writes ``report.md``, ``timeline.html`` and ``figures.json`` into it. Every
table states the scale, since every time in it is scaled.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._fleet_figures import KINDS, PolicyFigures, campaign_figures, load_policy_log
from bench._fleet_trace import WINDOWS, Event, Trace
from ckptd.goodput.report import COLOURS, MARK_COLOURS, MARK_SYMBOLS, MissingExtra

#: Lane state -> colour, the run report's for the same meaning.
STATE_COLOURS = {
    "stepping": COLOURS["productive"],
    "lost": COLOURS["lost"],
    "down": COLOURS["down"],
    "starting": COLOURS["restore"],
    "saving": COLOURS["save"],
}
STATE_LABELS = {
    "stepping": "stepping",
    "lost": "lost (done again)",
    "down": "down / replacing",
    "starting": "restoring / starting",
    "saving": "saving",
}
#: Mark kind -> (symbol, colour); a notice's colour is its cloud's.
MARK_STYLES = {
    "notice aws": (MARK_SYMBOLS["notice"], "#ff9900"),
    "notice gcp": (MARK_SYMBOLS["notice"], "#4285f4"),
    "notice azure": (MARK_SYMBOLS["notice"], "#8661c5"),
    "notice": (MARK_SYMBOLS["notice"], MARK_COLOURS["notice"]),
    "kill": (MARK_SYMBOLS["interrupted"], MARK_COLOURS["interrupted"]),
    "gone": ("x-open", MARK_COLOURS["interrupted"]),
    "replaced": (MARK_SYMBOLS["safe"], MARK_COLOURS["safe"]),
}


def _cell(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "—"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: Sequence[str], align: str, rows: Iterable[Sequence[str]]) -> str:
    """``align``: one ``l`` or ``r`` per column."""
    rule = ["---" if a == "l" else "---:" for a in align]
    return "\n".join([_row(header), _row(rule), *(_row(r) for r in rows)])


def scale_line(trace: Trace) -> str:
    """The scale in words, said with every figure."""
    return (
        f"scale {trace.scale:g} (scaled s per cloud s: an AWS notice gives "
        f"{WINDOWS['aws'] * trace.scale:g} s, a GCP or Azure one {WINDOWS['gcp'] * trace.scale:g} s)"
    )


def trace_table(trace: Trace) -> str:
    """The trace, one row per event."""
    rows = [
        [
            str(k + 1),
            f"{e.at:.1f}",
            e.category,
            e.provider or "—",
            ", ".join(str(n) for n in e.nodes),
            f"{e.window:.1f}",
            f"{e.replace_after:.1f}",
        ]
        for k, e in enumerate(trace.events)
    ]
    return _table(
        ["event", "at s", "kind", "cloud", "nodes", "notice window s", "replaced after s"],
        "rrlllrr",
        rows,
    )


def _lost(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "—"


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values):.1f} / {max(values):.1f}"


def _yes(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def policy_table(figures: Iterable[PolicyFigures]) -> str:
    """One row per policy: goodput, losses by kind, resume, bit-identity."""
    rows = []
    for f in figures:
        lost = f.lost_steps_by_kind
        rate = f.resume_success_rate
        rows.append(
            [
                f.policy,
                _cell(f.goodput, 3),
                _cell(f.goodput_less_wait, 3),
                _cell(f.wall, 1),
                _cell(f.replacement_wait, 1),
                _cell(f.steps),
                str(len(f.interruptions)),
                *(_lost(lost[k]) for k in KINDS),
                _spread(f.replace_to_first_step),
                "—" if rate is None else f"{100 * rate:.0f} %",
                _yes(f.bit_identical),
            ]
        )
    return _table(
        [
            "policy",
            "goodput ÷ uninterrupted",
            "less replacement wait",
            "wall s",
            "replacement wait s",
            "steps",
            "interruptions",
            "steps lost: notice",
            "kill",
            "reclaim",
            "replacement → first step s (median / max)",
            "resume success",
            "bit-identical",
        ],
        "lrrrrrrlllrrl",
        rows,
    )


def interruption_table(figures: Iterable[PolicyFigures]) -> str:
    """One row per interruption of every policy."""
    rows = [
        [
            f.policy,
            str(k + 1),
            i.kind,
            i.provider or "—",
            ", ".join(str(n) for n in i.nodes),
            str(i.highest_step),
            _cell(i.resumed_from),
            _cell(i.expected_step),
            _cell(i.lost_steps),
            _cell(i.replace_to_first_step, 1),
            "yes" if i.succeeded else "**no**",
        ]
        for f in figures
        for k, i in enumerate(f.interruptions)
    ]
    return _table(
        [
            "policy",
            "#",
            "kind",
            "cloud",
            "nodes",
            "highest step",
            "resumed at",
            "newest committed",
            "lost",
            "replacement → first step s",
            "resumed right",
        ],
        "lrlllrrrrrl",
        rows,
    )


def report_markdown(trace: Trace, figures: Sequence[PolicyFigures], machine: str) -> str:
    """The campaign's section for docs/benchmarks.md: what ran, then the tables."""
    return "\n\n".join(
        [
            f"Trace: seed {trace.seed}, {trace.nodes} nodes, {len(trace.events)} events over "
            f"{trace.duration:.0f} scaled s; {scale_line(trace)}. Machine: {machine}.",
            policy_table(figures),
            interruption_table(figures),
            trace_table(trace),
        ]
    )


def lane(policy: str, node: int) -> str:
    """A lane's name on the timeline."""
    return f"{policy} · node {node}"


def timeline_html(trace: Trace, figures: Sequence[PolicyFigures]) -> str:
    """Lanes per node per policy, coloured by state, notices (by cloud) and kills marked;
    each policy's time axis starts at its own origin (its first step)."""
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise MissingExtra("the timeline needs plotly: pip install '.[report]'") from exc
    lanes = [
        lane(f.policy, n)
        for f in figures
        for n in sorted({s.node for s in f.segments} | {m.node for m in f.marks})
    ]
    fig = go.Figure()
    for state, colour in STATE_COLOURS.items():
        mine = [(f.policy, s) for f in figures for s in f.segments if s.state == state]
        if mine:
            fig.add_trace(
                go.Bar(
                    name=STATE_LABELS[state],
                    orientation="h",
                    x=[s.end - s.start for _, s in mine],
                    base=[s.start for _, s in mine],
                    y=[lane(p, s.node) for p, s in mine],
                    marker_color=colour,
                    hovertemplate=f"{state}: %{{x:.1f}} s from %{{base:.1f}} s<extra></extra>",
                )
            )
    for kind, (symbol, colour) in MARK_STYLES.items():
        marks = [
            (f.policy, m)
            for f in figures
            for m in f.marks
            if (f"{m.kind} {m.provider}" if m.kind == "notice" and m.provider else m.kind) == kind
        ]
        if marks:
            fig.add_trace(
                go.Scatter(
                    name=kind,
                    mode="markers",
                    x=[m.at for _, m in marks],
                    y=[lane(p, m.node) for p, m in marks],
                    marker={"symbol": symbol, "size": 12, "color": colour},
                    hovertemplate=f"{kind} at %{{x:.1f}} s<extra></extra>",
                )
            )
    fig.update_layout(
        title=(
            f"fleet campaign: seed {trace.seed}, {trace.nodes} nodes, "
            f"{len(trace.events)} events, {scale_line(trace)}"
        ),
        barmode="overlay",
        xaxis_title="seconds since the policy's first step",
        yaxis={"categoryorder": "array", "categoryarray": lanes[::-1], "title": "lane"},
        height=220 + 40 * len(lanes),
        template="plotly_white",
    )
    return str(fig.to_html(include_plotlyjs=True, full_html=True))


def figures_json(f: PolicyFigures) -> dict[str, Any]:
    """One policy's figures as JSON-able data (the lanes left out)."""
    doc = {k: v for k, v in asdict(f).items() if k not in ("segments", "marks")}
    doc["lost_steps_by_kind"] = f.lost_steps_by_kind
    doc["replace_to_first_step"] = f.replace_to_first_step
    return doc


def campaign_trace(out: Path) -> Trace:
    """The trace a campaign played: ``trace.json`` (``Trace.to_json``), else rebuilt from
    ``campaign.json``'s seed, nodes, scale and events."""
    if (out / "trace.json").is_file():
        return Trace.from_json((out / "trace.json").read_text())
    doc = json.loads((out / "campaign.json").read_text())
    events = tuple(
        Event(e["at"], e["kind"], tuple(e["nodes"]), e["provider"], e["window"], e["replace_after"])
        for e in doc.get("events", [])
    )
    duration = doc.get("duration") or max((e.replaced_at for e in events), default=0.0)
    return Trace(int(doc["seed"]), int(doc["nodes"]), float(doc["scale"]), duration, events)


def this_machine() -> str:
    """The machine in a few words, for the report's first line."""
    return f"{platform.node()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def write(out: Path, names: Sequence[str], *, machine: str | None = None) -> dict[str, Any]:
    """Read the campaign under ``out`` (the policies ``names``), write ``report.md``,
    ``timeline.html`` (when plotly is there) and ``figures.json`` beside the logs, print
    the policy table; return the figures by policy as ``figures.json`` holds them."""
    trace = campaign_trace(out)
    figures = list(campaign_figures({n: load_policy_log(out / n) for n in names}).values())
    (out / "report.md").write_text(report_markdown(trace, figures, machine or this_machine()))
    doc = {f.policy: figures_json(f) for f in figures}
    (out / "figures.json").write_text(json.dumps(doc, indent=1))
    try:
        (out / "timeline.html").write_text(timeline_html(trace, figures))
    except MissingExtra as exc:
        print(f"no timeline: {exc}")
    print(f"{scale_line(trace)}\n{policy_table(figures)}\nreport: {out / 'report.md'}")
    return doc
