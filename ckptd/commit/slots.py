"""Slots: where one content of a checkpoint name lives in the store, and who writes it.

Pure: the claim and redirect formats, slot names, and the rules that decide which slot a
writer ships into; no I/O (``ckptd.commit.single`` reads and writes).

    <run>/<slot>/ckptd.claim.json      create-only, before any object of the slot: the
                                       one writer of the slot's objects
    <run>/<slot>/<path>                the objects
    <run>/<slot>/ckptd.manifest.json   create-only: present = committed. In a name's
                                       canonical slot it may instead hold a redirect:
                                       the name's content for that trajectory is in
                                       another slot, named by the redirect. Any slot's
                                       may hold a withdrawal: housekeeping took the
                                       uncommitted slot away (``ckptd.commit.withdrawal``)

A checkpoint's *name* is its entry in the watch dir; its *slot* is where one content of
that name lives in the store. The first content of a name takes the name itself (its
home), so the common case keeps the plain layout ``<run>/<name>/<path>`` users copy with
``aws s3 cp``. Another content of the name takes ``<name>~<8 letters>``:

- a trajectory other than the home's (a rollback re-saving names the abandoned one used)
  has its canonical slot at ``<name>~<trajectory id>`` (the run's first trajectory,
  whose id is "", at ``<name>~original``);
- a writer that finds the canonical slot claimed by another writer (two writers racing,
  a zombie beside its relaunch, a node that died mid-upload and its replacement) ships
  into a private slot ``<name>~<tag>`` of its own.

**I1: committed bytes never change.** Every writer writes only keys of a slot whose claim
names it, and aborts or deletes only those; so no writer, racing or late, can overwrite
or abort an object another writer's manifest names, on any store.

**I2: one content per name and trajectory.** It is kept by one create-only object: the
manifest key of the name's canonical slot for that trajectory. Its owner commits by
writing its manifest there; a writer in a private slot commits by writing a *redirect*
there first (exactly one of the two create-only writes wins), then its own manifest in
its slot. The loser finds the winner's manifest or redirect: a conflict unless the
contents are the same, never overwritten. A redirect never names a slot whose claim is
not the redirect's writer's.

**I1 against deleters: nothing deletes under a writer that can still commit.** Whatever
deletes objects of a slot that holds no manifest (``rm``, ``prune``, retention on any node) first writes a
*withdrawal* at the slot's manifest key, create-only: once it stands, no manifest can
follow, so the deleted objects are never named by one; if a manifest won the key first,
the slot is committed and is not deleted as uncommitted.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ckptd.core.manifest import ManifestError, check_path_component, check_trajectory_id
from ckptd.core.names import WITHDRAWN_FORMAT

CLAIM_FORMAT = "ckptd.claim/1"
REDIRECT_FORMAT = "ckptd.redirect/1"
#: Between a name and the letters of a slot other than its home.
SLOT_SEPARATOR = "~"
#: The canonical slot of the run's first trajectory (id "") when another holds the home.
ORIGINAL = "original"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    def to_bytes(self) -> bytes:
        doc = self.model_dump(mode="json", exclude_none=True)
        return (json.dumps(doc, indent=2) + "\n").encode()


class Claim(_Model):
    """``ckptd.claim.json``: the one writer of a slot's objects and manifest."""

    format: str = CLAIM_FORMAT
    run_id: str
    checkpoint: str  # the slot
    name: str  # the checkpoint's local name
    writer: str  # ``Journal.writer``: one daemon's state (survives its restarts)
    host: str
    claimed_at: str
    trajectory: str  # the trajectory id of the content it is for
    canonical: str  # the slot whose manifest key commits this name for that trajectory
    node_rank: int | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != CLAIM_FORMAT:
            raise ValueError(f"unknown claim format {value!r}")
        return value

    @field_validator("checkpoint", "name", "run_id", "canonical")
    @classmethod
    def _component(cls, value: str) -> str:
        return check_path_component(value)

    @field_validator("trajectory")
    @classmethod
    def _trajectory(cls, value: str) -> str:
        return check_trajectory_id(value)


class Redirect(_Model):
    """What a private slot's writer puts at its canonical slot's manifest key: the name's
    content for the claim's trajectory is committed in slot ``to``."""

    format: str = REDIRECT_FORMAT
    run_id: str
    checkpoint: str  # the canonical slot
    name: str
    to: str  # the slot holding the committed manifest
    writer: str
    host: str
    redirected_at: str
    trajectory: str

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != REDIRECT_FORMAT:
            raise ValueError(f"unknown redirect format {value!r}")
        return value

    @field_validator("checkpoint", "name", "run_id", "to")
    @classmethod
    def _component(cls, value: str) -> str:
        return check_path_component(value)


class Withdrawal(_Model):
    """What housekeeping puts at an uncommitted slot's manifest key before deleting any of
    its objects (I3): the slot is never committed. ``by`` says who (``rm`` on a host,
    retention of a daemon), ``reason`` why, ``writer`` whose claim it withdrew (if any)."""

    format: str = WITHDRAWN_FORMAT
    run_id: str
    checkpoint: str  # the slot
    by: str
    host: str
    withdrawn_at: str
    reason: str
    writer: str | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != WITHDRAWN_FORMAT:
            raise ValueError(f"unknown withdrawal format {value!r}")
        return value


def parse_withdrawal(data: bytes) -> Withdrawal | None:
    """The withdrawal ``data`` holds, or None when it is something else."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != WITHDRAWN_FORMAT:
        return None
    try:
        return Withdrawal.model_validate(doc)
    except ValidationError:
        return None


def parse_claim(data: bytes) -> Claim:
    try:
        return Claim.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"invalid claim: {exc.errors()[0]['msg']}") from None


def parse_redirect(data: bytes) -> Redirect | None:
    """The redirect ``data`` holds, or None when it is something else (a manifest)."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != REDIRECT_FORMAT:
        return None
    try:
        return Redirect.model_validate(doc)
    except ValidationError:
        return None


def letters(value: int, count: int = 8) -> str:
    """``count`` lowercase letters from an integer (no digits: a slot's step is its name's)."""
    out = []
    for _ in range(count):
        value, digit = divmod(value, len(_ALPHABET))
        out.append(_ALPHABET[digit])
    return "".join(out)


def trajectory_slot(name: str, trajectory: str) -> str:
    """The canonical slot of ``name`` on ``trajectory`` when the home belongs to another."""
    return f"{name}{SLOT_SEPARATOR}{trajectory or ORIGINAL}"


def private_slot(name: str, tag: str) -> str:
    """A writer's own slot for ``name`` (``tag``: 8 letters of its own)."""
    return f"{name}{SLOT_SEPARATOR}{tag}"


def canonical_for(
    name: str, trajectory: str, home: Claim | None, home_trajectory: str | None
) -> str:
    """The slot whose manifest key commits ``name`` on ``trajectory``: the home when it is
    unclaimed (its first writer takes it) or belongs to that trajectory (by its claim, or
    for a home committed before claims existed, by its manifest: ``home_trajectory``),
    else ``trajectory_slot``. A claim for another local name (a name that itself looks
    like ``<name>~<letters>``) never makes a home this name's."""
    if home is not None:
        return (
            name
            if (home.name, home.trajectory) == (name, trajectory)
            else trajectory_slot(name, trajectory)
        )
    if home_trajectory is None or home_trajectory == trajectory:
        return name
    return trajectory_slot(name, trajectory)


__all__ = [
    "CLAIM_FORMAT",
    "ORIGINAL",
    "REDIRECT_FORMAT",
    "SLOT_SEPARATOR",
    "Claim",
    "Redirect",
    "Withdrawal",
    "canonical_for",
    "letters",
    "parse_claim",
    "parse_redirect",
    "parse_withdrawal",
    "private_slot",
    "trajectory_slot",
]
