"""The fleet campaign's policies: how each one runs the same job on the same trace.

- ``uninterrupted``: no events; the trainer alone (no daemon), no saves. The reference:
  its final digest and its step rate.
- ``ckptd``: every rank under ``ckptd exec`` (restore before start, the trainer's saves
  every ``save_every`` steps shipped and committed across nodes, a notice turned into an
  emergency save on every rank), peer replication on.
- ``ckptd-no-peers``: the same with ``[peers] enabled = false``.
- ``sync-loop``: the trainer alone saving every ``save_every`` steps into its node dir, a
  loop per node copying complete-looking step dirs to the store (bench/_fleet_sync.py),
  and on every relaunch a blind restart from the newest step in the store, downloaded
  whole without verification (bench/_fleet_sync.py ``blind_restore``).

The invariant: a policy is data; bench_fleet.py and the scheduler do the running.
"""

from __future__ import annotations

from dataclasses import dataclass

NAMES = ("uninterrupted", "ckptd", "ckptd-no-peers", "sync-loop")


@dataclass(frozen=True)
class Policy:
    name: str
    mode: str  # "exec" (under ckptd exec) | "plain" (the trainer alone)
    peers: bool = False
    events: bool = True  # plays the trace
    saves: bool = True  # periodic saves every save_every steps
    sync: bool = False  # the sync loop and the blind restart


POLICIES = {
    "uninterrupted": Policy("uninterrupted", "plain", events=False, saves=False),
    "ckptd": Policy("ckptd", "exec", peers=True),
    "ckptd-no-peers": Policy("ckptd-no-peers", "exec", peers=False),
    "sync-loop": Policy("sync-loop", "plain", sync=True),
}


def parse(names: str) -> list[Policy]:
    """``a,b,c`` into policies, ``uninterrupted`` first (the others are judged by it)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; one of {list(NAMES)}")
    return [POLICIES[n] for n in NAMES if n in wanted]
