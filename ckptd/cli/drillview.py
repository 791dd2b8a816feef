"""A run's drills as people read them, for ``ckptd status`` and ``ckptd report``: the
success rate over the last drills (and of those that resumed the trainer), the last one's
result with each stage's own time (or the stage that failed and why), and the schedule,
with the periods it missed. Pure presentation of the JSON the
daemon answers (``DrillSummary.to_json``) or the report builds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptd.core.manifest import utc_timestamp


def drill_line(run: str, summary: Mapping[str, Any], schedule: Mapping[str, Any] | None) -> str:
    """'run1: 3 of the last 4 passed; last ... passed: signalled 0.001 s, ...; next due ...'."""
    drills, passed = int(summary.get("drills") or 0), int(summary.get("passed") or 0)
    parts = [f"{run}: none yet" if drills == 0 else f"{run}: {passed} of the last {drills} passed"]
    last: Mapping[str, Any] = summary.get("last") or {}
    if last:
        when = utc_timestamp(float(last.get("finished") or 0))
        kind = "" if last.get("kind") == "full" else f" {last.get('kind')}"
        if last.get("result") == "success":
            stages = ", ".join(
                f"{s['stage']} {s['seconds']:.3f} s"
                for s in last.get("stages") or []
                if s.get("seconds") is not None
            )
            parts.append(f"last{kind} {when} passed: {stages}")
        else:
            parts.append(
                f"last{kind} {when} FAILED at {last.get('failed_stage')}: {last.get('error')}"
            )
    if summary.get("resumes"):
        parts.append(f"{summary.get('resumes_passed')} of {summary['resumes']} resumed the trainer")
    if schedule:
        missed, last_missed = schedule.get("missed_periods"), schedule.get("last_missed")
        if missed and last_missed:
            parts.append(
                f"SCHEDULE MISSED {missed} period(s) in a row, last due "
                f"{last_missed.get('due')}: {last_missed.get('why')}"
            )
        if schedule.get("skipping"):
            parts.append(f"due {schedule.get('next_due')}, waiting: {schedule['skipping']}")
        elif schedule.get("next_due"):
            parts.append(f"next due {schedule['next_due']}")
    return "; ".join(parts)


__all__ = ["drill_line"]
