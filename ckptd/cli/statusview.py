"""``ckptd status`` for people: the ``/v1/status`` document as a rich table.

One row per run: pending checkpoints, the upload in flight with its progress, the last
committed checkpoint, the sync lag and the failed attempts (the count
``ckptd_checkpoints_failed_total`` has); a line above for the destination, with why it is
unreachable (and one per further tier: reachable, its backlog, its last commit), one per
run whose queued checkpoint last failed (why) and per checkpoint given up, one per
checkpoint waiting for other nodes (many nodes), one for the preemption notice below and
one per run for the advised checkpoint cadence and one for its drills. Pure presentation: it takes the document,
asks nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptd.cli.drillview import drill_line
from ckptd.cli.humanize import human_bytes, human_seconds
from ckptd.cli.peersview import peers_text

BAR_WIDTH = 16
# A run quiet for longer than this gets a line naming its watch dir and what it holds.
QUIET_SHOWN_SECONDS = 3600.0


def progress_text(uploading: Mapping[str, Any] | None) -> Text:
    """'checkpoint-20 ███████░░░ 45% 1.2/2.7 GiB', or '-' when nothing is in flight."""
    if not uploading:
        return Text("-", style="dim")
    total = int(uploading.get("bytes_total") or 0)
    sent = min(int(uploading.get("bytes_sent") or 0), total) if total else 0
    fraction = sent / total if total else 0.0
    filled = round(fraction * BAR_WIDTH)
    text = Text(f"{uploading.get('checkpoint', '?')} ")
    text.append("█" * filled, style="green")
    text.append("░" * (BAR_WIDTH - filled), style="dim")
    text.append(f" {fraction * 100:3.0f}% {human_bytes(sent)}/{human_bytes(total)}")
    return text


def _latest(run: Mapping[str, Any]) -> Text:
    """What LATEST names (a daemon older than ``latest``: its last commit), and the last
    commit in time below it when that is another checkpoint."""
    latest = run.get("latest") or run.get("last_committed")
    last = run.get("last_committed")
    if not latest:
        return Text("-", style="dim")
    step = latest.get("step")
    text = Text(str(latest.get("checkpoint", "?")))
    if step is not None:
        text.append(f" (step {step})", style="dim")
    if latest.get("committed_at"):
        text.append(f"\n{latest['committed_at']}", style="dim")
    if last and last.get("checkpoint") != latest.get("checkpoint"):
        text.append(f"\nlast commit: {last.get('checkpoint')}", style="dim")
    return text


def _lag(seconds: float) -> Text:
    # Colour only: the thresholds that page someone live in the alert rules.
    style = "green" if seconds < 60 else "yellow" if seconds < 600 else "bold red"
    return Text(human_seconds(seconds), style=style)


def status_table(doc: Mapping[str, Any]) -> Table:
    """The per-run table of a ``/v1/status`` document."""
    table = Table(title=None, expand=False)
    table.add_column("RUN", style="bold", no_wrap=True)
    table.add_column("PENDING", justify="right")
    table.add_column("UPLOADING", no_wrap=True)
    table.add_column("LATEST")
    table.add_column("LAG", justify="right")
    table.add_column("FAILED", justify="right")
    runs: Mapping[str, Any] = doc.get("runs") or {}
    for run_id, run in sorted(runs.items()):
        pending = list(run.get("pending") or [])
        failed = failed_count(run)
        table.add_row(
            run_id,
            str(len(pending)),
            progress_text(run.get("uploading")),
            _latest(run),
            _lag(float(run.get("sync_lag_seconds") or 0)),
            Text(str(failed), style="bold red" if failed else "dim"),
        )
    return table


def failed_count(run: Mapping[str, Any]) -> int:
    """The run's failed attempts, as ``ckptd_checkpoints_failed_total`` counts them (a
    daemon older than ``failures`` said only how many checkpoints it gave up)."""
    failures = run.get("failures")
    if isinstance(failures, Mapping):
        return int(failures.get("count") or 0)
    return len(run.get("failed") or {})


def failures_text(doc: Mapping[str, Any]) -> list[Text]:
    """Per run: why its queued checkpoint last failed, and each checkpoint given up
    (but a conflict, which ``conflicts_text`` shows)."""
    lines = []
    for run_id, run in sorted((doc.get("runs") or {}).items()):
        last = (run.get("failures") or {}).get("last") or {}
        if last and last.get("checkpoint") in (run.get("pending") or []):
            text = Text.assemble(("failing: ", "bold red"), f"{run_id}/{last['checkpoint']} ")
            text.append(f"({last.get('reason', '?')}, {last.get('at') or '?'}): ", style="dim")
            text.append(str(last.get("error") or "?"), style="red")
            lines.append(text)
        conflicts = run.get("conflicts") or {}
        for name, why in sorted((run.get("failed") or {}).items()):
            if name in conflicts:
                continue  # a CONFLICT line of its own says more (conflicts_text)
            text = Text.assemble(("given up: ", "bold red"), f"{run_id}/{name}: ")
            text.append(str(why), style="red")
            lines.append(text)
    return lines


def notice_text(preemption: Mapping[str, Any] | None) -> Text:
    """The notice line: 'notice: none', or source, kind and deadline in red."""
    if not preemption or not preemption.get("notice"):
        return Text.assemble(("notice: ", "bold"), ("none", "green"))
    text = Text.assemble(("notice: ", "bold"))
    text.append(f"{preemption.get('source', '?')}/{preemption.get('kind', '?')}", style="bold red")
    text.append(f"  noticed {preemption.get('noticed_at') or '?'}")
    text.append(f"  deadline {preemption.get('deadline') or 'unknown'}")
    return text


def notice_sources_text(doc: Mapping[str, Any]) -> list[Text]:
    """One line per cloud notice source: listening, or DEAF with its last error."""
    lines = []
    for name, health in sorted((doc.get("notice_sources") or {}).items()):
        text = Text.assemble(("notices from ", "bold"), (name, "bold"), ": ")
        last = health.get("last_success")
        when = _ago(float(last)) if last else "never"
        if health.get("up"):
            text.append("listening", style="green")
            text.append(f"  last read {when}", style="dim")
        else:
            text.append("NOT HEARD", style="bold red")
            failures = health.get("consecutive_failures") or 0
            text.append(f"  {failures} failed reads, last success {when}: ")
            text.append(str(health.get("error") or "no read yet"), style="red")
        lines.append(text)
    return lines


def health_text(health: Mapping[str, Any] | None) -> Text | None:
    """The node's health ([health] enabled): healthy, or UNHEALTHY with the last event;
    the sources that cannot be read; None with [health] off."""
    if health is None:
        return None
    text = Text.assemble(("health: ", "bold"))
    if health.get("healthy"):
        text.append("healthy", style="green")
    else:
        text.append("UNHEALTHY", style="bold red")
    last = health.get("last_event")
    if last:
        text.append(f"  last {last.get('source')}/{last.get('kind')} ({last.get('severity')})")
        text.append(f" {_ago(float(last.get('at') or 0))}: {last.get('message', '')}", style="dim")
    if health.get("saving"):
        text.append("  saving for it", style="yellow")
    down = {n: why for n, why in (health.get("sources") or {}).items() if why != "ok"}
    for name, why in sorted(down.items()):
        text.append(f"\n  health source {name} not read: {why}", style="red")
    return text


def loss_text(doc: Mapping[str, Any]) -> list[Text]:
    """Per run reporting its loss: the last one, whether a spike is open, the rollback
    targets kept from retention for it."""
    lines = []
    for run, body in sorted((doc.get("loss") or {}).items()):
        text = Text.assemble(
            ("loss: ", "bold"), f"{run} {body.get('loss')} at step {body.get('step')}"
        )
        events = body.get("events") or []
        if body.get("volatile") and events:
            last = events[-1]
            text.append(f"  {last.get('kind')} at step {last.get('step')}", style="bold red")
        elif events:
            text.append("  stable", style="green")
        if body.get("suspect_from_step") is not None:
            text.append(f"  saves from step {body['suspect_from_step']} suspect", style="red")
        if body.get("protected"):
            text.append(f"  kept for a rollback: {', '.join(body['protected'])}", style="yellow")
        lines.append(text)
    return lines


def quiet_runs_text(doc: Mapping[str, Any]) -> list[Text]:
    """A run with no commit for over an hour: its watch dir and what was seen there."""
    lines = []
    for run, body in sorted((doc.get("runs") or {}).items()):
        quiet = float(body.get("seconds_without_commit") or 0)
        if quiet < QUIET_SHOWN_SECONDS:
            continue
        seen = body.get("watch_dir_seen") or {}
        text = Text.assemble(
            ("no commit ", "bold yellow"), f"of {run} for {human_seconds(quiet)}: "
        )
        if not seen:
            text.append(f"{body.get('dir')} not looked at yet")
        elif not seen.get("exists"):
            text.append(f"{body.get('dir')} does not exist", style="red")
        else:
            names = ", ".join(e["name"] for e in seen.get("newest") or []) or "nothing"
            text.append(f"{body.get('dir')} holds {seen.get('entries', 0)} entries ({names})")
        lines.append(text)
    return lines


def _ago(unix_time: float) -> str:
    return f"{max(0.0, time.time() - unix_time):.0f}s ago"


def trainer_text(trainer: Mapping[str, Any] | None) -> Text | None:
    """The supervised trainer (``ckptd exec``): pid, starts, restarts, last exit; None
    under ``ckptd run``."""
    if not trainer:
        return None
    text = Text.assemble(("trainer: ", "bold"))
    pid = trainer.get("pid")
    text.append(f"pid {pid}" if pid else "not running", style="green" if pid else "yellow")
    text.append(f"  starts {trainer.get('starts', 0)}  restarts {trainer.get('restarts', 0)}")
    text.append(f"/{trainer.get('max_restarts', '?')}")
    last = trainer.get("last_exit") or {}
    if last:
        text.append(f"  last exit {last.get('cause', '?')}")
    if trainer.get("resumed_from"):
        text.append(f"  resumed from {trainer['resumed_from']}")
    restored = trainer.get("restored") or {}
    if restored and not restored.get("skipped"):
        # Before the first start: where its bytes came from (the store's egress).
        text.append(
            f"  restored {restored.get('checkpoint')} from {restored.get('tier', '?')} "
            f"({human_bytes(restored.get('peer_bytes', 0))} from peers, "
            f"{human_bytes(restored.get('store_bytes', 0))} from the store)"
        )
    if trainer.get("gave_up"):
        text.append(f"  gave up: {trainer['gave_up']}", style="bold red")
    return text


def destination_text(destination: Mapping[str, Any] | None) -> Text:
    """'destination: URL  ok', or UNREACHABLE and why (the last check's error)."""
    destination = destination or {}
    text = Text.assemble(("destination: ", "bold"), str(destination.get("url") or "?"), "  ")
    _reachability(text, destination)
    return text


def _reachability(text: Text, destination: Mapping[str, Any]) -> None:
    if destination.get("ok"):
        text.append("ok", style="green")
        return
    text.append("UNREACHABLE", style="bold red")
    if destination.get("error"):
        text.append(f": {destination['error']}", style="red")


def tiers_text(doc: Mapping[str, Any]) -> list[Text]:
    """Several tiers: one line per further tier (the first is the destination line and
    the table): reachable or not, its backlog, its newest committed step per run."""
    tiers: Mapping[str, Any] = doc.get("tiers") or {}
    lines = []
    for name, tier in list(tiers.items())[1:]:
        destination = tier.get("destination") or {}
        text = Text.assemble((f"tier {name}: ", "bold"), str(destination.get("url") or "?"), "  ")
        _reachability(text, destination)
        for run_id, run in sorted((tier.get("runs") or {}).items()):
            last = run.get("last_committed") or {}
            backlog = len(run.get("pending") or [])
            text.append(f"  {run_id}: last {last.get('checkpoint') or '-'}")
            if backlog:
                text.append(f", {backlog} behind", style="yellow")
        lines.append(text)
    return lines


def waiting_text(doc: Mapping[str, Any]) -> list[Text]:
    """Many nodes: one line per checkpoint whose part is written, waiting for others'."""
    lines = []
    runs: Mapping[str, Any] = doc.get("runs") or {}
    for run_id, run in sorted(runs.items()):
        for entry in run.get("waiting") or []:
            missing = ", ".join(str(r) for r in entry.get("missing_nodes") or []) or "?"
            text = Text.assemble(("waiting: ", "bold yellow"))
            text.append(f"{run_id}/{entry.get('checkpoint', '?')}")
            text.append(f" for node(s) {missing}", style="yellow")
            text.append(f"  since {entry.get('since') or '?'}", style="dim")
            lines.append(text)
    return lines


def conflicts_text(doc: Mapping[str, Any]) -> list[Text]:
    """One line per local checkpoint refused because another content holds its name."""
    lines = []
    runs: Mapping[str, Any] = doc.get("runs") or {}
    for run_id, run in sorted(runs.items()):
        for name, detail in sorted((run.get("conflicts") or {}).items()):
            theirs = detail.get("theirs") or {}
            text = Text.assemble(("CONFLICT: ", "bold red"), f"{run_id}/{name}")
            text.append(
                f" held by {theirs.get('host', '?')} (slot {theirs.get('slot', '?')}); "
                "kept here, not committed",
                style="red",
            )
            lines.append(text)
    return lines


def advice_text(doc: Mapping[str, Any]) -> list[Text]:
    """One line per run: the advised interval, what it rests on, and what the current
    cadence costs against it (expected share of time lost to saving plus lost work)."""
    lines = []
    advice: Mapping[str, Any] = doc.get("advice") or {}
    for run_id, a in sorted(advice.items()):
        text = Text.assemble(("cadence: ", "bold"), f"{run_id} ")
        text.append(f"save every {human_seconds(float(a.get('interval_seconds', 0)))}", "cyan")
        basis = a.get("basis") or {}
        text.append(
            f"  (save {float(a.get('save_seconds', 0)):.1f}s {basis.get('save', '?')}, "
            f"MTBF {human_seconds(float(a.get('mtbf_seconds', 0)))} {basis.get('mtbf', '?')})"
        )
        if basis.get("loss") == "volatile":  # halved while the loss is (docs/health.md)
            text.append("  halved: loss volatile", "yellow")
        if a.get("history") in ("reading", "unreadable"):  # the store's: prior till then
            text.append(f"  store history {a['history']}", "yellow")
        cost = a.get("expected_cost") or {}
        advised, current = cost.get("advised") or {}, cost.get("current")
        text.append(f"  lost {100 * float(advised.get('total_fraction', 0)):.1f}%")
        if current:
            text.append(
                f" vs {100 * float(current.get('total_fraction', 0)):.1f}% now "
                f"(every {human_seconds(float(current.get('interval_seconds', 0)))})",
                style="dim",
            )
        lines.append(text)
    return lines


def drills_text(doc: Mapping[str, Any]) -> list[Text]:
    """One line per run with a drill or a schedule: the success rate, the last drill
    (each stage's time, or where it failed, in red), the next one."""
    drills: Mapping[str, Any] = doc.get("drills") or {}
    lines = []
    for run_id, summary in sorted(drills.items()):
        schedule = doc.get("drill_schedule")
        schedule = schedule if schedule and schedule.get("run") == run_id else None
        if not summary.get("drills") and not schedule:
            continue
        last = summary.get("last") or {}
        failed = bool(last) and last.get("result") != "success"
        text = Text.assemble(("drills: ", "bold"))
        text.append(drill_line(run_id, summary, schedule), style="bold red" if failed else "")
        lines.append(text)
    return lines


def render_status(doc: Mapping[str, Any], console: Console) -> None:
    """Print a ``/v1/status`` document: destination, the per-run table, the notice."""
    console.print(destination_text(doc.get("destination")))
    for line in tiers_text(doc):
        console.print(line)
    if doc.get("runs"):
        console.print(status_table(doc))
    else:
        console.print(Text("no runs watched", style="dim"))
    for line in [*failures_text(doc), *waiting_text(doc), *conflicts_text(doc)]:
        console.print(line)
    console.print(notice_text(doc.get("preemption")))
    for line in [*notice_sources_text(doc), *quiet_runs_text(doc)]:
        console.print(line)
    health = health_text(doc.get("health"))
    if health is not None:
        console.print(health)
    for line in loss_text(doc):
        console.print(line)
    for line in advice_text(doc):
        console.print(line)
    for line in drills_text(doc):
        console.print(line)
    for line in peers_text(doc):  # peer replication ([peers] enabled)
        console.print(line)
    trainer = trainer_text(doc.get("trainer"))
    if trainer is not None:
        console.print(trainer)
    goodput = goodput_text(doc.get("goodput"))
    if goodput is not None:
        console.print(goodput)


def goodput_text(goodput: Mapping[str, Any] | None) -> Text | None:
    """The run's goodput (``ckptd exec``'s ledger): the ratio, its biggest badput causes,
    steps lost; None without a ledger."""
    run: Mapping[str, Any] = (goodput or {}).get("run") or {}
    ratio = run.get("goodput_ratio")
    if ratio is None:
        return None
    text = Text.assemble(("goodput: ", "bold"), f"{100 * ratio:.1f} %")
    day = ((goodput or {}).get("last_24h") or {}).get("goodput_ratio")
    if day is not None:
        text.append(f" (last 24 h {100 * day:.1f} %)")
    seconds: Mapping[str, float] = run.get("seconds") or {}
    worst = sorted(
        ((s, c) for c, s in seconds.items() if c != "productive" and s > 0), reverse=True
    )[:3]
    if worst:
        text.append("  badput " + ", ".join(f"{c} {s:.0f} s" for s, c in worst))
    text.append(f"  interruptions {run.get('interruptions', 0)}")
    text.append(f"  steps lost {run.get('lost_steps', 0)}")
    if run.get("no_step_reports"):
        text.append(
            "\n  no step reports arrived: call ckptd.trainer.report_step(step) after each "
            "step (docs/goodput.md)",
            style="yellow",
        )
    return text


__all__ = [
    "advice_text",
    "conflicts_text",
    "drills_text",
    "failed_count",
    "failures_text",
    "goodput_text",
    "health_text",
    "loss_text",
    "progress_text",
    "render_status",
    "status_table",
    "tiers_text",
    "waiting_text",
]
