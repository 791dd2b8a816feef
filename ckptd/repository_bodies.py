"""The bodies of the layout's small objects, parsed: part of ``ckptd.repository``.

``ckptd.repository`` is the only code that spells a key or parses what the store holds;
this module is the parsing half for the objects that are not manifests or LATEST
(``ckptd.core.manifest`` parses those): what stands at a slot's manifest key when it is
a redirect or a withdrawal, a restore's lease, the run's NOTICE. Pure functions of the
bytes read, re-exported by ``ckptd.repository`` (import them from there); none raises on
garbage, which is never taken for one of these objects.
"""

from __future__ import annotations

import json
from typing import Any

from ckptd.core.names import REDIRECT_FORMAT, WITHDRAWN_FORMAT

NOTICE_FORMAT = "ckptd.notice/1"
# A NOTICE is a few hundred bytes; anything much larger is not one (never parse it).
NOTICE_MAX_BYTES = 64 * 1024
LEASE_TTL_SECONDS = 3600.0


def lease_checkpoint(body: bytes, key_name: str) -> str | None:
    """The checkpoint a lease protects: from its JSON body, else from ``<NAME>-<uuid>``."""
    try:
        doc = json.loads(body)
        name = doc.get("checkpoint") if isinstance(doc, dict) else None
        if isinstance(name, str) and name:
            return name
    except ValueError:
        pass
    head, sep, token = key_name.rpartition("-")
    return head if sep and len(token) == 32 else None


def lease_is_fresh(body: bytes, now: float, ttl: float = LEASE_TTL_SECONDS) -> bool:
    """Whether a lease holds at ``now``: one with an ``until`` (a protection, e.g. a loss
    spike's rollback target) until then, any other for ``ttl`` seconds from its
    ``taken_at``; a lease whose time cannot be read counts as fresh (when unsure, keep)."""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and "until" in doc:
            return now < float(doc["until"])
        taken = float(doc["taken_at"])
    except (ValueError, KeyError, TypeError):
        return True
    return now - taken < ttl


def lease_why(body: bytes) -> str:
    """Why a lease was taken: its ``why`` (``loss-spike``, ``non-finite``), else
    ``restore`` (a restore's lease, which says no more)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "restore"
    why = doc.get("why") if isinstance(doc, dict) else None
    return why if isinstance(why, str) and why else "restore"


def parse_notice_document(body: bytes) -> dict[str, Any] | None:
    """A NOTICE's JSON object when it is one of ours (``format`` ckptd.notice/1), else None;
    never raises: garbage in the store is no notice."""
    if len(body) > NOTICE_MAX_BYTES:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != NOTICE_FORMAT:
        return None
    return doc


def redirect_target(body: bytes) -> str | None:
    """The slot a redirect (``ckptd.commit.slots.Redirect``) names, or None when ``body``
    is not one: what stands at a canonical slot's manifest key when another slot holds
    the name's committed content."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != REDIRECT_FORMAT:
        return None
    target = doc.get("to")
    return target if isinstance(target, str) and target and "/" not in target else None


def is_withdrawal(body: bytes) -> bool:
    """Whether ``body`` (what stands at a slot's manifest key) is a withdrawal
    (``ckptd.commit.withdrawal``): the slot was taken out of the commit protocol, and
    nothing of it is, or ever will be, committed."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("format") == WITHDRAWN_FORMAT


def withdrawn_why(body: bytes) -> str | None:
    """ "withdrawn by WHO on HOST at WHEN (REASON)" when ``body`` is a withdrawal."""
    if not is_withdrawal(body):
        return None
    doc = json.loads(body)
    return (
        f"withdrawn by {doc.get('by', '?')} on {doc.get('host', '?')} at "
        f"{doc.get('withdrawn_at', '?')} ({doc.get('reason', '')})"
    )
