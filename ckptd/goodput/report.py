"""``ckptd report --run RUN``: the run ledger as a summary for the terminal and as an HTML
timeline (one lane per node, coloured by cause, notices, commits and interruptions marked).

The timeline is drawn with plotly (the ``report`` extra): one self-contained HTML file,
interactive (each interval's cause, basis, steps and length on hover; zoom into one
interruption of a week-long run), whose lanes and markers are SVG a browser's DOM shows.
Nothing here reads the store: records and the cadence advice are arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from ckptd.cadence.model import Advice
from ckptd.core.extras import install_hint
from ckptd.goodput.model import (
    PRECEDENCE,
    UNKNOWN,
    Goodput,
    Interval,
    Mark,
    Record,
    timeline,
)

# One colour per cause (the HTML timeline, and the test that looks at it in a browser).
COLOURS = {
    "productive": "#2ca02c",
    "drill": "#17becf",
    "save": "#1f77b4",
    "wait_commit": "#9467bd",
    "lost": "#d62728",
    "restore": "#ff7f0e",
    "startup": "#bcbd22",
    "down": "#7f7f7f",
    UNKNOWN: "#c7c7c7",
}
MARK_SYMBOLS = {
    "notice": "triangle-down",
    "commit": "diamond",
    "interrupted": "x",
    "finished": "star",
    "stopped": "square-open",
    "safe": "circle",
}
MARK_COLOURS = {
    "notice": "#e377c2",
    "commit": "#17becf",
    "interrupted": "#000000",
    "finished": "#8c564b",
    "stopped": "#7f7f7f",
    "safe": "#2ca02c",
}


class MissingExtra(Exception):
    """The plotting library is not installed (the ``report`` extra)."""


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def lost_comparison(run: Goodput, advice: Advice | None) -> dict[str, Any]:
    """Lost time per interruption: measured (the ledger) beside the cadence model's
    expectation (half a save cycle plus the upload) at the advised interval."""
    measured = [i.lost_seconds for i in run.interruptions]
    out: dict[str, Any] = {
        "interruptions": len(measured),
        "measured_mean_lost_seconds": round(sum(measured) / len(measured), 3) if measured else None,
    }
    if advice is not None:
        cycle = advice.interval_seconds + advice.save_seconds
        out["advised_interval_seconds"] = round(advice.interval_seconds, 3)
        out["expected_lost_seconds_at_advised"] = round(cycle / 2 + advice.upload_seconds, 3)
    return out


#: Said wherever goodput reads 0 % because no step report arrived.
NO_STEPS_HINT = (
    "no step reports arrived, so no time counts as productive (the trainer's reads as "
    "startup): call ckptd.trainer.report_step(step) after each training step (the HF and "
    "Lightning callbacks do); docs/goodput.md"
)


def summary_text(run_id: str, run: Goodput, day: Goodput, advice: Advice | None) -> str:
    """What ``ckptd report --run RUN`` prints."""
    if run.wall <= 0:
        return (
            f"run {run_id}: no ledger records (is it trained under ckptd exec, or beside "
            "ckptd run?)"
        )
    lines = [
        f"run {run_id}: {_clock(run.start)} -> {_clock(run.end)} ({_duration(run.wall)})",
        f"goodput {100 * (run.ratio or 0):.1f} %   last 24 h "
        + ("-" if day.ratio is None else f"{100 * day.ratio:.1f} %"),
        f"attempts {run.attempts} on {run.nodes} node(s), interruptions "
        f"{len(run.interruptions)}, steps lost "
        f"{sum(i.lost_steps or 0 for i in run.interruptions)}",
        "",
        f"{'CAUSE':<12} {'TIME':>10} {'SHARE':>7}",
    ]
    for cause in (*PRECEDENCE, UNKNOWN):
        seconds = run.seconds.get(cause, 0.0)
        if seconds > 0 or cause == "productive":
            lines.append(f"{cause:<12} {_duration(seconds):>10} {100 * seconds / run.wall:>6.1f}%")
    if run.interruptions:
        lines += ["", f"{'INTERRUPTED AT':<24} {'NODE':<16} {'CAUSE':<16} {'STEPS':>6} {'LOST':>9}"]
        for i in run.interruptions:
            steps = "?" if i.lost_steps is None else str(i.lost_steps)
            lines.append(
                f"{_clock(i.at):<24} {i.node:<16} {i.cause:<16} {steps:>6} "
                f"{_duration(i.lost_seconds):>9}"
            )
    if run.without_steps:
        lines += ["", NO_STEPS_HINT]
    compared = lost_comparison(run, advice)
    if advice is not None and compared["measured_mean_lost_seconds"] is not None:
        lines += [
            "",
            f"lost per interruption: measured {_duration(compared['measured_mean_lost_seconds'])}"
            f", expected at the advised interval ({_duration(advice.interval_seconds)}) "
            f"{_duration(compared['expected_lost_seconds_at_advised'])}",
        ]
    return "\n".join(lines)


def timeline_html(run_id: str, records: Sequence[Record], run: Goodput) -> str:
    """The run's timeline as one self-contained HTML page (module doc)."""
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise MissingExtra(f"the HTML timeline needs plotly, {install_hint('report')}") from exc
    nodes = sorted({r.node for r in records})
    fig = go.Figure()
    for cause in (*PRECEDENCE, UNKNOWN):
        xs: list[float] = []
        bases: list[float] = []
        ys: list[str] = []
        for node in nodes:
            mine = [r for r in records if isinstance(r, Interval) and r.node == node]
            if not mine:
                continue
            lo, hi = min(r.start for r in mine), max(r.end for r in mine)
            for seg in timeline(mine, lo, hi):
                if seg.cause == cause:
                    bases.append(seg.start - run.start)
                    xs.append(seg.end - seg.start)
                    ys.append(node)
        if xs:
            fig.add_trace(
                go.Bar(
                    name=cause,
                    orientation="h",
                    x=xs,
                    base=bases,
                    y=ys,
                    marker_color=COLOURS[cause],
                    hovertemplate=f"{cause}: %{{x:.1f}} s from %{{base:.1f}} s<extra></extra>",
                )
            )
    for kind, symbol in MARK_SYMBOLS.items():
        marks = [r for r in records if isinstance(r, Mark) and r.kind == kind]
        if marks:
            fig.add_trace(
                go.Scatter(
                    name=kind,
                    mode="markers",
                    x=[m.at - run.start for m in marks],
                    y=[m.node for m in marks],
                    marker={"symbol": symbol, "size": 14, "color": MARK_COLOURS[kind]},
                    text=[m.detail for m in marks],
                    hovertemplate=f"{kind} %{{text}} at %{{x:.1f}} s<extra></extra>",
                )
            )
    ratio = "-" if run.ratio is None else f"{100 * run.ratio:.1f} %"
    if run.without_steps:
        ratio += " (no step reports: call ckptd.trainer.report_step)"
    fig.update_layout(
        title=f"ckptd run {run_id}: goodput {ratio} over {_duration(run.wall)}",
        barmode="overlay",
        xaxis_title=f"seconds since {_clock(run.start)}",
        yaxis_title="node",
        height=220 + 80 * len(nodes),
        template="plotly_white",
    )
    return str(fig.to_html(include_plotlyjs=True, full_html=True))
