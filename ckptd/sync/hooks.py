"""What a pipeline tells the rest of the daemon, and asks of it: callables given to its
constructor (``SyncPipeline(..., hooks=PipelineHooks(...))``), never assigned later.

The defaults are those of a pipeline on its own (one tier, no responder, no advisor):
nothing is told, nothing holds it back, and local retention may delete what this
pipeline committed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptd.sync.request import ShipRequest

# (run, checkpoint, bytes, emergency): a checkpoint was committed (the responder's
# report of an emergency save waits for it).
CommitHook = Callable[[str, str, int, bool], Awaitable[None]]
# (run, checkpoint, complete at (wall clock), first file -> last file written (s),
# complete -> committed (s), emergency): what a committed checkpoint cost.
CostHook = Callable[[str, str, float, float, float, bool], None]
# (request, emergency, seconds left before the notice's deadline or None): step 0 is done
# for a checkpoint (its slot claimed), and no object of it is sent yet; what it returns,
# when not None, is awaited before the first object goes.
ClaimedHook = Callable[["ShipRequest", bool, "float | None"], "Awaitable[None] | None"]
# (run, checkpoint, emergency): this node's files of it are in the store (one node: its
# commit; many nodes: its part written, or the global commit).
StoredHook = Callable[[str, str, bool], None]


def _tell_nobody(run: str, name: str) -> None:
    return None


def _never_held() -> bool:
    return False


def _stored_nowhere(run: str, name: str, emergency: bool) -> None:
    return None


@dataclass(frozen=True)
class PipelineHooks:
    """The daemon's side of one pipeline."""

    # Awaited after every commit (``Responder.on_commit``).
    on_commit: CommitHook | None = None
    # A checkpoint completed during a notice (``Responder.on_complete``).
    on_emergency_complete: Callable[[str, str], None] = _tell_nobody
    # Each checkpoint shipped now, what it cost (``CadenceAdvisor.record_save``).
    on_cost: CostHook | None = None
    # The local checkpoints of a run local retention may delete; None: those this
    # pipeline committed (several tiers: those committed in every tier).
    locally_deletable: Callable[[str], set[str]] | None = None
    # Further tiers start nothing new while the first is in emergency mode.
    held: Callable[[], bool] = _never_held
    # Peer replication (``ckptd.sync.replicate``): a checkpoint's push starts once its slot
    # is claimed, and its holders hear when this node's part is in the store.
    on_claimed: ClaimedHook | None = None
    on_stored: StoredHook = _stored_nowhere
