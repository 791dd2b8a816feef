"""Completion rules: when is a checkpoint on local disk complete, and which files are it.

Every rule is pure (a listing snapshot and a clock value in, a ``Completion`` out); the
scanner in ``ckptd.sync.scanner`` does the I/O. ``evaluate`` is the one entry point.
"""

from __future__ import annotations

import re

from ckptd.layouts.base import (
    LAYOUT_NAMES,
    SCRATCH_FILES,
    TRACKER_FILES,
    CheckpointListing,
    Completion,
    CompletionRule,
    FileEntry,
    RuleSettings,
    step_of,
)
from ckptd.layouts.dcp import DcpRule
from ckptd.layouts.deepspeed import DeepSpeedRule
from ckptd.layouts.hf import HfRule
from ckptd.layouts.lightning import LightningRule
from ckptd.layouts.marker import MarkerRule
from ckptd.layouts.megatron import MegatronRule
from ckptd.layouts.orbax import TMP_MARKER, OrbaxRule
from ckptd.layouts.quiescent import QuiescentRule

__all__ = [
    "AUTO_ORDER",
    "LAYOUT_NAMES",
    "RULES",
    "SCRATCH_FILES",
    "TRACKER_FILES",
    "CheckpointListing",
    "Completion",
    "CompletionRule",
    "DcpRule",
    "DeepSpeedRule",
    "FileEntry",
    "HfRule",
    "LightningRule",
    "MarkerRule",
    "MegatronRule",
    "OrbaxRule",
    "QuiescentRule",
    "RuleSettings",
    "evaluate",
    "is_checkpoint_candidate",
    "pick_rule",
    "step_of",
]

#: One rule per concrete layout name (every LAYOUT_NAMES entry but "auto").
RULES: dict[str, CompletionRule] = {
    rule.name: rule
    for rule in (
        HfRule(),
        DcpRule(),
        DeepSpeedRule(),
        MegatronRule(),
        LightningRule(),
        OrbaxRule(),
        MarkerRule(),
        QuiescentRule(),
    )
}

#: The order in which ``auto`` tries rules; the first that recognises a checkpoint judges
#: it, and ``quiescent`` judges what none recognises. Most specific first: hf before dcp
#: (the Trainer nests DCP dirs under FSDP), marker last as it needs a file to be recognised.
AUTO_ORDER: tuple[str, ...] = ("hf", "dcp", "deepspeed", "megatron", "orbax", "lightning", "marker")

# Helper files frameworks leave beside their checkpoints: DeepSpeed copies its recovery
# script next to the tags and keeps a second tracker for universal checkpoints; Megatron's
# --log-progress appends to progress.txt in the save dir.
_SIDECAR_FILES = frozenset({"zero_to_fp32.py", "latest_universal", "progress.txt"})
# Names a child has while a framework (or a user's save-then-rename) is still writing it:
# orbax's "<step>.orbax-checkpoint-tmp-<ts>", transformers' old "tmp-checkpoint-<N>" (its
# tmp-dir + rename, since reverted), "tmp_save_500/" or "ckpt-500.tmp/" of a hand-written
# loop, and the usual partial-file suffixes (the old pytorch_lightning atomic_save wrote
# "<name>.part"). Such a name is never a checkpoint, step number or not: under auto the
# quiet fallback would otherwise commit the half that is there before the rename.
_TEMP_NAME = re.compile(
    r"(?:tmp|temp)(?:[-_.]|$).*"  # tmp_save_500, tmp-checkpoint-500, temp.ckpt
    r"|.*[-_.](?:tmp|temp|part|partial|incomplete|inprogress|in_progress)"  # ckpt-500.tmp
    r"|.*~",
    re.IGNORECASE,
)


def is_checkpoint_candidate(name: str, is_dir: bool) -> bool:
    """Whether a direct child of a watch dir may be a checkpoint at all."""
    if not name or name.startswith("."):
        return False  # .ckptd/ (our own) and hidden temp files
    if not is_dir and (name in TRACKER_FILES or name in _SIDECAR_FILES):
        return False
    return TMP_MARKER not in name and not _TEMP_NAME.fullmatch(name)


def pick_rule(layout: str, listing: CheckpointListing, settings: RuleSettings) -> CompletionRule:
    """The rule that judges ``listing`` under ``layout`` (resolving ``auto`` per checkpoint)."""
    if layout != "auto":
        try:
            return RULES[layout]
        except KeyError:
            raise ValueError(
                f"unknown layout {layout!r}; expected one of {', '.join(LAYOUT_NAMES)}"
            ) from None
    for name in AUTO_ORDER:
        # recognises() sees no settings, so the marker rule is built for this marker.
        rule = MarkerRule(settings.marker) if name == "marker" else RULES[name]
        if rule.recognises(listing):
            return rule
    return RULES["quiescent"]


def evaluate(
    layout: str, listing: CheckpointListing, now_ns: int, settings: RuleSettings
) -> Completion:
    """Judge one checkpoint under ``layout`` ("auto" or a concrete name) at time ``now_ns``."""
    if listing.unshippable:
        # A restore would lack what the trainer wrote there: refuse, loudly, rather than
        # commit a checkpoint that silently misses a file.
        first = listing.unshippable[0]
        return Completion(
            complete=False,
            layout=layout,
            reason=f"{len(listing.unshippable)} entr{'y' if len(listing.unshippable) == 1 else 'ies'}"
            f" cannot be shipped (a dangling symlink, a link to a directory or a special "
            f"file), e.g. {first}: replace it with the file, or remove it",
        )
    rule = pick_rule(layout, listing, settings)
    if layout == "auto" and rule.name == "quiescent" and not _looks_like_a_checkpoint(listing):
        # An output dir also holds things that are no checkpoint: HF's final
        # model.safetensors and config.json, TensorBoard's runs/, logs. Under auto the
        # quiescent safety net covers only step-numbered directories; name a layout
        # (quiescent, marker) to ship anything else.
        return Completion(
            complete=False,
            layout="auto",
            reason="not recognised as a checkpoint: no layout matched and the name has no step",
        )
    return rule.evaluate(listing, now_ns, settings)


def _looks_like_a_checkpoint(listing: CheckpointListing) -> bool:
    return listing.is_dir and step_of(listing.name) is not None
