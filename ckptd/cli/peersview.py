"""``ckptd status``'s peer replication lines, from ``/v1/status``'s ``peers`` (present only
with ``[peers] enabled``): this node's peer address and the peers it knows, the replicas it
holds against its quota, each run's latest push and whether it made the checkpoint safe,
the emergency checkpoint's way off the node, and the hand-offs this node made."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.text import Text

from ckptd.cli.humanize import human_bytes


def peers_text(doc: Mapping[str, Any]) -> list[Text]:
    """The lines (none without peer replication)."""
    peers: Mapping[str, Any] | None = doc.get("peers")
    if not peers:
        return []
    held: Mapping[str, Any] = peers.get("replicas") or {}
    domain = f" ({peers['failure_domain']})" if peers.get("failure_domain") else ""
    lines = [
        Text.assemble(
            ("peers: ", "bold"),
            f"{peers.get('address') or '?'}{domain}, {len(peers.get('known') or [])} known; "
            f"holding {held.get('count', 0)} replica(s), "
            f"{human_bytes(int(held.get('bytes') or 0))} of {human_bytes(int(held.get('quota_bytes') or 0))}",
        )
    ]
    preemption: Mapping[str, Any] = doc.get("preemption") or {}
    if preemption.get("safe_via"):
        lines.append(
            Text(
                f"  emergency checkpoint safe off the node via {preemption['safe_via']} "
                f"{preemption.get('safe_after_s')} s after the notice",
                style="green",
            )
        )
    for run, push in sorted((peers.get("replication") or {}).items()):
        kind = "emergency" if push.get("emergency") else "routine"
        acked = [
            p["address"] for p in push.get("peers") or [] if p.get("outcome") == "acknowledged"
        ]
        if push.get("outcome") == "safe":
            said, style = (
                f"safe on {', '.join(acked)} in {push.get('acknowledged_after_s')} s",
                "green",
            )
        elif push.get("outcome") == "not_safe":
            why = (
                ", ".join(str(p.get("outcome")) for p in push.get("peers") or []) or "no peer known"
            )
            said, style = f"NOT safe on peers ({why})", "red"
        else:
            said, style = "pushing", ""
        lines.append(Text(f"  {run}/{push.get('checkpoint')} ({kind}): {said}", style=style))
    for h in peers.get("handoffs") or []:
        lines.append(
            Text(
                f"  handed off node {h.get('node')}'s {h.get('run')}/{h.get('checkpoint')} "
                f"({human_bytes(int(h.get('bytes') or 0))}): {h.get('outcome')}"
                + (f" ({h['error']})" if h.get("error") else ""),
                style="red" if h.get("outcome") in ("failed", "refused") else "",
            )
        )
    return lines


__all__ = ["peers_text"]
