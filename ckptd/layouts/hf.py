"""Hugging Face ``transformers.Trainer`` checkpoints: ``checkpoint-<N>/``.

Write order, from ``Trainer._save_checkpoint`` (src/transformers/trainer.py): ``save_model``
(weights, config, tokenizer, ``training_args.bin``), then ``_save_optimizer_and_scheduler``,
``_save_scaler`` and ``_save_rng_state`` (one ``rng_state_<rank>.pth`` per process), and
``trainer_state.json`` last, by the main process only (``args.should_save``); then
``_rotate_checkpoints`` may delete older ``checkpoint-*`` dirs. Everything is written in
place: the tmp-dir + rename was reverted (PR #36112).

So ``trainer_state.json`` says the main process is done, not that every rank is: other
ranks may still be writing their RNG state or optimizer shards (FSDP, DeepSpeed ZeRO under
the Trainer). Hence a short quiet window (``settle_seconds``) and no writers on top. The
JIT-checkpoint callback (Kubeflow trainer / transformers) brackets the save with
``checkpoint-is-incomplete.txt``; while it exists the save is in progress.

A save is not the only thing that touches a checkpoint dir: rotation (``save_total_limit``)
``rmtree``s old ones, and a trainer killed mid-rotation (OOM, ``kill -9``) leaves a dir that
is quiet forever, maybe with ``trainer_state.json`` but without its weights. So the weights
must be there too, as the Trainer's own loader requires (``_load_from_checkpoint`` refuses
a dir without ``model.safetensors``, ``pytorch_model.bin``, their ``.index.json``, an
adapter, or an FSDP ``pytorch_model_fsdp*`` dir; under DeepSpeed a ``global_step*`` dir).
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

NAME = re.compile(r"checkpoint-\d+")
TRAINER_STATE = "trainer_state.json"
INCOMPLETE_SENTINEL = "checkpoint-is-incomplete.txt"

# Files only the Trainer writes at a checkpoint's root. Recognising by these, and not by the
# name alone, leaves a custom trainer's "checkpoint-<N>" dirs to the quiescent fallback
# instead of waiting forever for a trainer_state.json that never comes; recognising by more
# than trainer_state.json keeps a half-written Trainer checkpoint under this rule.
# ``save_model`` comes first and writes through ``save_pretrained`` (config, then
# weights), so a save killed that early holds only those: they count too, or the quiescent
# fallback would call such a dir complete once quiet (committed, and resumed from). A
# custom loop that writes ``checkpoint-<N>/`` with ``save_pretrained`` and no
# trainer_state.json names its layout (marker, quiescent).
_TRAINER_FILES = re.compile(
    r"trainer_state\.json|training_args\.bin|checkpoint-is-incomplete\.txt"
    r"|optimizer\.(pt|bin)|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth"
    r"|config\.json|generation_config\.json"
    r"|(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?"
)


# What the Trainer's loader accepts as weights (see the module doc).
_WEIGHTS = re.compile(
    r"(model\.safetensors|pytorch_model\.bin)(\.index\.json)?|adapter_model\.(safetensors|bin)"
    r"|(pytorch_model_fsdp|global_step)[^/]*/.+"
)


class HfRule:
    """``checkpoint-<N>/`` from ``transformers.Trainer``."""

    name = "hf"

    def recognises(self, listing: CheckpointListing) -> bool:
        """A ``checkpoint-<N>`` dir holding a file only the Trainer writes."""
        return (
            listing.is_dir
            and NAME.fullmatch(listing.name) is not None
            and any(_TRAINER_FILES.fullmatch(f.path) for f in listing.files)
        )

    def evaluate(
        self, listing: CheckpointListing, now_ns: int, settings: RuleSettings
    ) -> Completion:
        """Complete when trainer_state.json is there, the sentinel is gone, and all is quiet."""
        if not listing.is_dir or NAME.fullmatch(listing.name) is None:
            return not_complete(self.name, "not a checkpoint-<N> directory")
        if not listing.files:
            return not_complete(self.name, "empty directory")
        if listing.has(INCOMPLETE_SENTINEL):
            return not_complete(self.name, f"{INCOMPLETE_SENTINEL} present: save in progress")
        if not listing.has(TRAINER_STATE):
            return not_complete(self.name, f"no {TRAINER_STATE} yet (it is written last)")
        if not any(_WEIGHTS.fullmatch(f.path) for f in listing.files):
            # Rotation deleting it, killed half-way (module doc): never complete again.
            return not_complete(self.name, f"{TRAINER_STATE} but no model weights")
        return settled(
            self.name,
            listing,
            now_ns,
            settings.settle_seconds,
            f"{TRAINER_STATE} written and quiet for {settings.settle_seconds:g}s",
        )
