"""The names of the objects ckptd keeps beside a checkpoint's files in the store.

Pure. ``ckptd.repository`` spells every key from these; the commit protocol
(``ckptd.commit``) reads and writes the objects. None of them is ever one of a
checkpoint's files: a manifest's entries are, and only they.
"""

from __future__ import annotations

import re

from ckptd.core.manifest import MANIFEST_NAME

#: Written create-only before any object of a slot: the slot's one writer
#: (``ckptd.commit.slots``).
CLAIM_NAME = "ckptd.claim.json"
#: What a name's canonical slot holds at its manifest key when another slot holds the
#: committed content (``ckptd.commit.slots``).
REDIRECT_FORMAT = "ckptd.redirect/1"
#: What housekeeping puts at an uncommitted slot's manifest key, create-only, before it
#: deletes any of the slot's objects: no writer can commit that slot afterwards
#: (``ckptd.commit.withdrawal``).
WITHDRAWN_FORMAT = "ckptd.withdrawn/1"
#: Many nodes: written by the node holding the framework's commit record.
ANNOUNCE_NAME = "ckptd.announce.json"
#: Many nodes: one node's verified files, ``ckptd.part-<rank>.json``.
PART_PREFIX = "ckptd.part-"
PART_SUFFIX = ".json"

_PART_RE = re.compile(r"^ckptd\.part-(\d+)\.json$")


def part_name(rank: int) -> str:
    return f"{PART_PREFIX}{rank}{PART_SUFFIX}"


def rank_of_part(name: str) -> int | None:
    """The node rank a ``ckptd.part-<rank>.json`` object name carries, else None."""
    m = _PART_RE.match(name)
    return int(m.group(1)) if m else None


def is_protocol_object(name: str) -> bool:
    """Whether an object name (last component) is one of these, never a file."""
    return name in (MANIFEST_NAME, CLAIM_NAME) or is_cluster_object(name)


def is_cluster_object(name: str) -> bool:
    """Whether an object name (last component) is an announcement or a part."""
    return name == ANNOUNCE_NAME or rank_of_part(name) is not None


__all__ = [
    "ANNOUNCE_NAME",
    "CLAIM_NAME",
    "MANIFEST_NAME",
    "PART_PREFIX",
    "PART_SUFFIX",
    "REDIRECT_FORMAT",
    "WITHDRAWN_FORMAT",
    "is_cluster_object",
    "is_protocol_object",
    "part_name",
    "rank_of_part",
]
