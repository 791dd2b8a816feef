"""Many nodes, one checkpoint: the announcement and part objects, and their merge.

Pure: models, the save identity, the merge of parts into the global manifest's file
list, and the rules that decide what a node may do; no I/O, no clock (times are
arguments). ``ckptd.repository`` reads and writes these objects; ``ckptd.commit.assemble``
acts on the verdicts.

    <run>/<checkpoint>/ckptd.announce.json     the node holding the commit record says
                                               "this save is complete"
    <run>/<checkpoint>/ckptd.part-<rank>.json  one node's files, written once verified
    <run>/<checkpoint>/ckptd.manifest.json     the union of all parts (``nodes``, ``save``)

The invariant every rule here keeps: the files of a global manifest all come from parts
that carry the ``save`` of the one current announcement, and each path is listed once
with one content. A part of another save is never merged (it is ignored until its node
ships again); two parts naming one path with different bytes are a conflict, never
committed.

Why a node without the commit record may call its part complete once the save is
announced and its own files are quiet and closed, by framework (read in their sources):

- torch DCP, ``torch/distributed/checkpoint/state_dict_saver.py`` ``_save_state_dict``:
  ``distW.all_reduce("write", write_data, finish_checkpoint)`` runs ``write_data`` on every
  rank (``storage_writer.write_data(...)`` then ``all_writes.wait()``), gathers the
  results on the coordinator (``_DistWrapper.all_reduce`` in ``utils.py``:
  ``gather_object``), and only then calls ``FileSystemWriter.finish``
  (``filesystem.py``), which writes ``.metadata.tmp``, fsyncs it and renames it to
  ``.metadata``. So ``.metadata`` on node 0 implies every rank's ``__<rank>_<n>.distcp``
  on every node is written and closed: the quiet window is a safety net.
- DeepSpeed, ``deepspeed/runtime/engine.py`` ``DeepSpeedEngine.save_checkpoint``: every
  rank saves its model/ZeRO files, then ``self.checkpoint_engine.commit(tag)``, then
  ``if save_latest and rank == 0`` writes ``latest``, and only *then* ``dist.barrier()``.
  No barrier stands between another rank's last write and ``latest``: a node's
  ``zero_pp_rank_*`` files may still be open when ``latest`` appears, so the quiet,
  closed window is what makes the part complete. (Older releases wrote ``latest`` on
  *every* rank right after its own ZeRO files: every node then holds a record, and the
  lowest rank's announcement wins, ``announcer_may_overwrite``.)
- Megatron, ``megatron/training/checkpointing.py`` ``save_checkpoint``: every rank
  saves, ``torch.distributed.barrier()``, then rank 0 writes
  ``latest_checkpointed_iteration.txt`` (then another barrier): the tracker follows
  every rank's files, as DCP's ``.metadata`` does.
- Hugging Face ``Trainer._save_checkpoint`` (``transformers/trainer.py``): ``save_model``
  (under FSDP/DeepSpeed every rank writes its shards), ``_save_optimizer_and_scheduler``,
  ``_save_rng_state`` (every rank writes ``rng_state_<process_index>.pth``), then
  ``if self.args.should_save: self.state.save_to_json(trainer_state.json)`` with no
  barrier between: another node's RNG file can land just after ``trainer_state.json``.
  With ``save_on_each_node`` every node's local main writes ``trainer_state.json``; the
  lowest rank's announcement wins (``announcer_may_overwrite``).

What ties a follower's files to the announced save is time. Where the record follows a
gather or a barrier of every rank (DCP, Megatron), no rank's file is newer than the
announcing node's newest file but for the nodes' clock difference (``CLOCK_SKEW_SECONDS``);
elsewhere a short tail of writes may follow the record (HF's RNG state, DeepSpeed's
barrier-less ``latest``: ``SAVE_TAIL_SECONDS``). Files newer than that belong to a later
save and wait for its announcement (``files_fit_save``, ``save_tail_seconds``). So a
re-save under the same name while the announcing node's daemon is down (it would
withdraw the old announcement at once) is told apart from the old save when it comes
more than the tail later: 2 s for DCP and Megatron (a restart and the steps up to the
same name take longer), 30 s for the others. Nodes' clocks must agree within the tail.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ckptd.core import checksum
from ckptd.core.manifest import (
    ManifestError,
    ManifestFile,
    Parent,
    Trajectory,
    check_path_component,
)

ANNOUNCE_FORMAT = "ckptd.announce/1"
PART_FORMAT = "ckptd.part/1"
#: Files this much newer than the announcing node's newest file belong to a later save.
SAVE_TAIL_SECONDS = 30.0
#: The same where the record follows every rank's files: the nodes' clock difference.
CLOCK_SKEW_SECONDS = 2.0
#: Layouts whose commit record is written only after every rank's files (module doc).
RECORD_AFTER_EVERY_RANK: frozenset[str] = frozenset({"dcp", "megatron"})
#: An uncommitted checkpoint older than the newest committed step is given up (its
#: announcement and parts swept) once its announcement is this old.
ABANDON_GRACE_SECONDS = 3600.0


def save_id(fingerprint: Iterable[tuple[str, int, int]]) -> str:
    """The save a node's files are: CRC-32C (hex) of its sorted ``(path, size, mtime_ns)``;
    stable across a daemon's restarts, different for a re-save under the same name."""
    text = "".join(f"{p}\t{s}\t{m}\n" for p, s, m in sorted(fingerprint))
    return checksum.to_hex(checksum.crc32c(text.encode()))


# Fields added with slots and trajectories: absent when unset, as a manifest's optional
# ones, so an announcement without them is as it was.
_OPTIONAL = ("slot", "canonical", "writer", "trajectory", "parent", "objects", "suspect")


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    def to_bytes(self) -> bytes:
        doc = self.model_dump(mode="json")
        for key in _OPTIONAL:
            if doc.get(key, "") is None:
                del doc[key]
        if isinstance(doc.get("trajectory"), dict):
            doc["trajectory"] = {k: v for k, v in doc["trajectory"].items() if v is not None}
        for entry in doc.get("files", []):  # a part's files: digest only when authenticated
            if entry.get("digest", "") is None:
                del entry["digest"]
        return (json.dumps(doc, indent=2) + "\n").encode()


class Announcement(_Model):
    """``ckptd.announce.json``: the node holding the commit record says a save is complete."""

    format: str = ANNOUNCE_FORMAT
    run_id: str
    checkpoint: str
    save: str
    node_rank: int = Field(ge=0)
    layout: str
    step: int | None
    announced_at: str  # RFC 3339 UTC, as the manifest's times
    # The announcing node's newest file mtime (ns): later files are a later save's.
    record_mtime_ns: int = 0
    # Where every node ships this save (``ckptd.commit.slots``): the slot the announcer
    # claimed (absent: the checkpoint's own name), the canonical slot that commits the
    # name, the claim's writer, and the save's trajectory and parent (the manifest's).
    slot: str | None = None
    canonical: str | None = None
    writer: str | None = None
    trajectory: Trajectory | None = None
    parent: Parent | Literal["scratch"] | None = None

    @property
    def slot_name(self) -> str:
        """The slot the save's objects, parts and manifest go to."""
        return self.slot or self.checkpoint

    @field_validator("format")
    @classmethod
    def _known(cls, value: str) -> str:
        if value != ANNOUNCE_FORMAT:
            raise ValueError(f"unknown announcement format {value!r}")
        return value


class Part(_Model):
    """``ckptd.part-<rank>.json``: one node's verified files of one save."""

    format: str = PART_FORMAT
    run_id: str
    checkpoint: str
    node_rank: int = Field(ge=0)
    nodes: int = Field(ge=1)
    save: str
    layout: str
    step: int | None
    host: str
    created_at: str
    verified_at: str
    total_bytes: int = Field(ge=0)
    files: list[ManifestFile]
    environment: dict[str, str] = Field(default_factory=dict)
    # Path -> the identity of the object this node wrote, as the store reported it once
    # its bytes were verified (``ckptd.commit.objects.object_identity``): the committer
    # commits only over these very objects, never over another writer's bytes written
    # at the same key since. Absent (an older node): held to the size alone.
    objects: dict[str, str] | None = None
    # Why this node's share is suspect (its trainer reported a non-finite loss before
    # the save: ``ckptd.health.loss``); absent otherwise, and from an older node.
    suspect: str | None = None

    @field_validator("format")
    @classmethod
    def _known(cls, value: str) -> str:
        if value != PART_FORMAT:
            raise ValueError(f"unknown part format {value!r}")
        return value

    @field_validator("checkpoint", "run_id")
    @classmethod
    def _one_component(cls, value: str) -> str:
        return check_path_component(value)


def parse_announcement(data: bytes) -> Announcement:
    try:
        return Announcement.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"invalid announcement: {exc.errors()[0]['msg']}") from None


def parse_part(data: bytes) -> Part:
    try:
        return Part.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "part"
        raise ManifestError(f"invalid part: {where}: {first['msg']}") from None


# -- the merge ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    """Not every node's part of the announced save is there yet."""

    missing: tuple[int, ...]
    stale: tuple[int, ...] = ()  # ranks whose part is of another save (ignored)


@dataclass(frozen=True)
class Conflict:
    """One path, different bytes on different nodes: never committed."""

    path: str
    versions: tuple[tuple[int, int, str], ...]  # (rank, size, crc32c)

    def describe(self) -> str:
        seen = ", ".join(f"node {r}: {s} B crc32c {c}" for r, s, c in self.versions)
        return f"{self.path!r} differs between nodes ({seen})"


@dataclass(frozen=True)
class Merged:
    """Every part of the save is there and agrees: the global manifest's files."""

    files: tuple[ManifestFile, ...]
    created_at: str
    # Path -> the object identities the parts recorded for it (several nodes may write
    # one path with the same bytes); a path no part recorded one for is absent.
    objects: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # The first part's (by rank) reason the save is suspect: the whole checkpoint is.
    suspect: str | None = None


MergeVerdict = Waiting | Conflict | Merged


def merge_parts(announcement: Announcement, parts: Mapping[int, Part], nodes: int) -> MergeVerdict:
    """Merge the parts of ``announcement``'s save (module doc's invariant).

    ``parts`` maps rank to the part found under that rank's name; a part of another save,
    run or checkpoint counts as missing (and is reported ``stale``)."""
    current: dict[int, Part] = {}
    stale: list[int] = []
    for rank, part in parts.items():
        if not 0 <= rank < nodes:
            continue
        if (
            part.save == announcement.save
            and part.node_rank == rank
            and part.run_id == announcement.run_id
            and part.checkpoint == announcement.checkpoint
        ):
            current[rank] = part
        else:
            stale.append(rank)
    missing = tuple(r for r in range(nodes) if r not in current)
    if missing:
        return Waiting(missing, tuple(sorted(stale)))
    by_path: dict[str, list[tuple[int, ManifestFile]]] = {}
    for rank in sorted(current):
        for f in current[rank].files:
            by_path.setdefault(f.path, []).append((rank, f))
    files: list[ManifestFile] = []
    for path in sorted(by_path):
        versions = by_path[path]
        contents = {(f.size, f.crc32c) for _, f in versions}
        if len(contents) > 1:
            return Conflict(path, tuple((r, f.size, f.crc32c) for r, f in versions))
        files.append(versions[0][1])
    written: dict[str, set[str]] = {}
    for part in current.values():
        for path, identity in (part.objects or {}).items():
            if identity:
                written.setdefault(path, set()).add(identity)
    return Merged(
        tuple(files),
        min(p.created_at for p in current.values()),
        {path: frozenset(ids) for path, ids in written.items()},
        next(
            (f"node {r}: {current[r].suspect}" for r in sorted(current) if current[r].suspect), None
        ),
    )


# -- who does what -----------------------------------------------------------------------


def is_announcer(layout: str, complete: bool, rank: int) -> bool:
    """Whether a node whose rule gave ``complete`` under ``layout`` holds the commit record.

    Every layout's rule but ``quiescent`` completes on a record the framework writes (or a
    marker), so it is the record's holder that announces; ``quiescent`` has no record (and
    is where ``auto`` lands for a node's shards without one), so there only node 0 does."""
    if not complete:
        return False
    return layout != "quiescent" or rank == 0


def announcer_may_overwrite(existing: Announcement | None, rank: int, save: str) -> bool:
    """Whether a record holder of ``rank`` writes its announcement over ``existing``: when
    there is none, when it is its own earlier one (a re-save), or one by a higher rank
    (several nodes holding the record, HF's ``save_on_each_node``: the lowest rank leads)."""
    if existing is None:
        return True
    if existing.save == save:
        return False  # already announced
    return existing.node_rank >= rank


def save_tail_seconds(layout: str) -> float:
    """How much newer than the announcing node's newest file a follower's files may be and
    still belong to the announced save (module doc)."""
    return CLOCK_SKEW_SECONDS if layout in RECORD_AFTER_EVERY_RANK else SAVE_TAIL_SECONDS


def files_fit_save(newest_mtime_ns: int, announcement: Announcement, tail_seconds: float) -> bool:
    """Whether a node's files (newest ``newest_mtime_ns``) may be of ``announcement``'s save
    (module doc: later files belong to a later save)."""
    if announcement.record_mtime_ns <= 0:
        return True
    return newest_mtime_ns <= announcement.record_mtime_ns + int(tail_seconds * 1e9)


def superseded(
    step: int | None,
    newest_committed_step: int | None,
    since: float,
    now: float,
    grace_seconds: float = ABANDON_GRACE_SECONDS,
) -> bool:
    """Whether an uncommitted checkpoint can never commit: its step is below the newest
    committed one and it has waited (``since``, epoch seconds) longer than the grace."""
    if step is None or newest_committed_step is None:
        return False
    return step < newest_committed_step and now - since > grace_seconds


def epoch_of(timestamp: str) -> float | None:
    """Epoch seconds of an RFC 3339 time as ckptd writes them; None if it does not parse."""
    try:
        return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def missing_of(parts: Mapping[int, Part], save: str, nodes: int) -> list[int]:
    """Ranks without a part of ``save``."""
    return [r for r in range(nodes) if r not in parts or parts[r].save != save]


def part_files(
    files: Sequence[tuple[str, int, str]], digests: Mapping[str, str] | None = None
) -> list[ManifestFile]:
    """A part's file entries; ``digests`` (path -> hex) with authenticated checkpoints."""
    found = digests or {}
    return [
        ManifestFile(path=p, size=s, crc32c=c, digest=found.get(p)) for p, s, c in sorted(files)
    ]


__all__ = [
    "ABANDON_GRACE_SECONDS",
    "SAVE_TAIL_SECONDS",
    "Announcement",
    "Conflict",
    "MergeVerdict",
    "Merged",
    "Part",
    "Waiting",
    "announcer_may_overwrite",
    "epoch_of",
    "files_fit_save",
    "is_announcer",
    "merge_parts",
    "missing_of",
    "parse_announcement",
    "parse_part",
    "part_files",
    "save_id",
    "superseded",
]
