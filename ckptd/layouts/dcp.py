"""``torch.distributed.checkpoint`` (DCP) directories: ``*.distcp`` plus ``.metadata``.

Write order (torch/distributed/checkpoint/state_dict_saver.py ``_save_state_dict``): every
rank runs ``write_data`` (``__<rank>_<n>.distcp``, fsynced); the coordinator gathers all
results and only then calls ``FileSystemWriter.finish`` (filesystem.py), which writes
``.metadata.tmp``, fsyncs it, deletes any old ``.metadata`` and renames the tmp file into
place. ``.metadata`` is therefore the commit record; ``.metadata.tmp`` alone is not.

With ``overwrite=True`` (the default) a save into a dir that already holds a checkpoint only
warns, so an old ``.metadata`` can sit beside new shards being written. A committed save's
``.metadata`` is newer than all its shards (finish runs after every write), so a shard
newer than ``.metadata`` means a re-save is in progress.

On node-local disks only the coordinator's node gets ``.metadata``; the other nodes' shards
are never complete by this rule alone (see docs/design.md "Many nodes, one checkpoint").
"""

from __future__ import annotations

from ckptd.layouts.base import (
    CheckpointListing,
    Completion,
    RuleSettings,
    not_complete,
    shippable,
)
from ckptd.layouts.megatron import MegatronRule

METADATA = ".metadata"
METADATA_TMP = ".metadata.tmp"
SHARD_SUFFIX = ".distcp"


def _root_shards(listing: CheckpointListing) -> list[int]:
    return [
        f.mtime_ns for f in listing.files if "/" not in f.path and f.path.endswith(SHARD_SUFFIX)
    ]


class DcpRule:
    """A directory written by ``torch.distributed.checkpoint.save``."""

    name = "dcp"

    def recognises(self, listing: CheckpointListing) -> bool:
        """A dir with ``*.distcp`` at its root that is not a Megatron ``iter_<N>``."""
        # Only root-level shards: the HF Trainer with FSDP nests DCP dirs inside
        # checkpoint-<N>/ (pytorch_model_fsdp_0/) and must be judged as a whole.
        # Megatron's torch_dist format is DCP too, but its own tracker is written after
        # metadata.json and friends, so the Megatron rule is the stricter judge there.
        return (
            listing.is_dir
            and bool(_root_shards(listing))
            and not MegatronRule().recognises(listing)
        )

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Complete when ``.metadata`` is present, newer than every shard, and not being written."""
        if not listing.is_dir:
            return not_complete(self.name, "not a directory")
        if not listing.files:
            return not_complete(self.name, "empty directory")
        metadata = next((f for f in listing.files if f.path == METADATA), None)
        if metadata is None:
            if listing.has(METADATA_TMP):
                return not_complete(self.name, f"{METADATA_TMP} not yet renamed to {METADATA}")
            return not_complete(self.name, f"no {METADATA} yet (the coordinator writes it last)")
        if listing.has(METADATA_TMP):
            # finish() is between writing the new .metadata.tmp and renaming it over the
            # old .metadata: the shards beside it belong to the new save.
            return not_complete(
                self.name, f"{METADATA_TMP} beside {METADATA}: a re-save is committing"
            )
        newer = [m for m in _root_shards(listing) if m > metadata.mtime_ns]
        if newer:
            return not_complete(
                self.name, f"{len(newer)} shard(s) newer than {METADATA}: a re-save is in progress"
            )
        writers = sorted(listing.open_for_write or ())
        if writers:
            return not_complete(
                self.name,
                f"{len(writers)} file(s) being written, e.g. {writers[0]}",
                recheck_after=settings.settle_seconds,
            )
        return Completion(
            complete=True,
            layout=self.name,
            reason=f"{METADATA} committed",
            files=shippable(listing),
        )
