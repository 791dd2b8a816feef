"""The run's cadence history in the store (``<run>/CADENCE``): read and written here,
parsed and serialised by ``ckptd.cadence.model``. Blocking; run it in a thread.

Garbage in the store reads as an empty history (``parse_history``): it costs the learned
figures, never the daemon.
"""

from __future__ import annotations

from ckptd.cadence.model import History, parse_history
from ckptd.repository import Repository


def read_history(repo: Repository, run_id: str) -> History:
    """The run's cadence history; an empty one when there is none or it is garbage."""
    body = repo.read_cadence_bytes(run_id)
    return History(run_id) if body is None else parse_history(body, run_id)


def write_history(repo: Repository, history: History) -> None:
    """Write (overwrite) the run's cadence history."""
    repo.write_cadence_bytes(history.run_id, history.to_bytes())
