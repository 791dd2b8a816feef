"""Megatron-LM checkpoints: ``iter_<N>/`` (7-digit, zero-padded) and a tracker file.

Write order (megatron/training/checkpointing.py ``save_checkpoint``): every rank writes its
part of ``iter_0000500/`` (``mp_rank_XX/model_optim_rng.pt``, ``distrib_optim.pt``, or the
torch_dist format's ``*.distcp``, ``.metadata``, ``common.pt``, ``metadata.json``); for a
synchronous save ``torch.distributed.barrier()`` follows, and only then rank 0 writes
``latest_checkpointed_iteration.txt`` = the iteration (``iter_finalize_fn``). With
``--async-save`` the same function is a finalize callback, run once every rank's writes
are done. So the tracker naming N means iteration N is on disk everywhere.

The tracker holds a number or ``release`` (a converted checkpoint in ``release/``). A
tracker past N means N was complete when the tracker moved (saves are sequential, each
finalised before the tracker moves on), the same reasoning as the DeepSpeed rule; the quiet
window and the writer check guard against a dir being rewritten by a run resumed from
further back.
"""

from __future__ import annotations

import re

from ckptd.layouts.base import (
    CheckpointListing,
    Completion,
    RuleSettings,
    not_complete,
    settled,
)

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
NAME = re.compile(r"iter_(\d{7,})")


class MegatronRule:
    """``iter_<N>/`` committed by ``latest_checkpointed_iteration.txt``."""

    name = "megatron"

    def recognises(self, listing: CheckpointListing) -> bool:
        """An ``iter_<NNNNNNN>`` dir, or ``release/`` while the tracker says ``release``."""
        if not listing.is_dir:
            return False
        if NAME.fullmatch(listing.name):
            return True
        return listing.name == RELEASE and listing.trackers.get(TRACKER) == RELEASE

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Complete when the tracker's iteration is at least this one and all is quiet."""
        if not listing.is_dir:
            return not_complete(self.name, "not a directory")
        if not listing.files:
            return not_complete(self.name, "empty directory")
        tracked = listing.trackers.get(TRACKER)
        if not tracked:
            # Absent, or caught between open('w') truncating it and the write.
            return not_complete(self.name, f"no iteration in {TRACKER} yet")
        window = settings.settle_seconds
        if listing.name == RELEASE:
            # A run started from release/ and saved on: release/ was whole before that.
            why = "names release" if tracked == RELEASE else f"has moved on to {tracked[:20]}"
            return settled(self.name, listing, now_ns, window, f"{TRACKER} {why}")
        mine = NAME.fullmatch(listing.name)
        if mine is None:
            return not_complete(self.name, "not an iter_<N> directory")
        if tracked == RELEASE:
            return not_complete(self.name, f"{TRACKER} says release, not an iteration")
        try:
            iteration = int(tracked)
        except ValueError:
            return not_complete(self.name, f"{TRACKER} holds {tracked[:40]!r}, not a number")
        if iteration < int(mine[1]):
            return not_complete(self.name, f"{TRACKER} is at {iteration}, not yet here")
        return settled(self.name, listing, now_ns, window, f"{TRACKER} is at {iteration}")
