"""DeepSpeed engine checkpoints: ``global_step<N>/`` beside a ``latest`` tracker.

Write order (deepspeed/runtime/engine.py ``DeepSpeedEngine.save_checkpoint``): rank 0
creates the save dir; every rank writes its part of the tag dir (``mp_rank_XX_model_states.pt``
from data-parallel rank 0, then ``*zero_pp_rank_*_optim_states.pt`` per rank); then
``checkpoint_engine.commit(tag)`` and rank 0 writes ``latest`` = the tag
(``open(..., 'w')``, not atomic), and only *then* ``dist.barrier()``.

There is no barrier between the other ranks' writes and rank 0's ``latest``, so on a node
with several ranks a ZeRO shard can still be in flight when ``latest`` names the tag: the
rule also waits for no writers and a short quiet window (``settle_seconds``).

Older tags: ``latest`` only ever names the newest save, and saves are sequential (each ends
with a barrier before training resumes), so a ``global_step<M>`` with M below the tracker's
step was complete when the tracker moved past it. Accepting it is what lets a daemon that
was down, or behind, still ship those checkpoints. The quiet window and the writer check
also guard this case against a tag dir being rewritten by a run resumed from further back.
A save that crashed half-way and was then skipped (the run resumed from an older tag and
saved other steps) would be taken as complete; that needs a crash *and* a changed save
interval, and is the price of not losing the common case.
"""

from __future__ import annotations

import re

from ckptd.layouts.base import (
    CheckpointListing,
    Completion,
    RuleSettings,
    basename,
    not_complete,
    settled,
)

TRACKER = "latest"
NAME = re.compile(r"global_step(\d+)")
# File names only DeepSpeed's engine writes inside a tag dir (model states, ZeRO optimizer
# partitions, pipeline layer files), so the rule recognises a save before `latest` exists.
_ENGINE_FILES = re.compile(
    r"(mp_rank_\d+_model_states|(bf16_|fp16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states"
    r"|layer_\d+-model_\d+-model_states|expp_rank_\d+_mp_rank_\d+_optim_states)\.pt"
)


class DeepSpeedRule:
    """``global_step<N>/`` committed by DeepSpeed's ``latest`` file."""

    name = "deepspeed"

    def recognises(self, listing: CheckpointListing) -> bool:
        """A ``global_step<N>`` dir beside ``latest`` or holding DeepSpeed engine files."""
        return (
            listing.is_dir
            and NAME.fullmatch(listing.name) is not None
            and (
                TRACKER in listing.trackers
                or any(_ENGINE_FILES.fullmatch(basename(f.path)) for f in listing.files)
            )
        )

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Complete when ``latest`` names this tag (or a later step) and all is quiet."""
        if not listing.is_dir:
            return not_complete(self.name, "not a directory")
        if not listing.files:
            return not_complete(self.name, "empty directory")
        tag = listing.trackers.get(TRACKER)
        if not tag:
            # Absent, or caught between open('w') truncating it and the write.
            return not_complete(self.name, f"no tag in {TRACKER!r} yet")
        if tag == listing.name:
            return settled(
                self.name, listing, now_ns, settings.settle_seconds, f"{TRACKER!r} names it"
            )
        mine, theirs = NAME.fullmatch(listing.name), NAME.fullmatch(tag)
        if mine is not None and theirs is not None and int(theirs[1]) > int(mine[1]):
            return settled(
                self.name,
                listing,
                now_ns,
                settings.settle_seconds,
                f"{TRACKER!r} has moved past it, to {tag}",
            )
        return not_complete(self.name, f"{TRACKER!r} names {tag}, not this tag")
