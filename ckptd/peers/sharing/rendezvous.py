"""How the nodes restoring one checkpoint find each other: a record each in the store.

A node that restores ``<run>``'s checkpoint writes
``<run>/.ckptd-sharing/<session>/<node>.json`` (``ckptd.repository.sharing_key``), where
``<session>`` names the checkpoint's slot and the manifest's identity (the same files,
sizes and CRC-32C: only nodes restoring exactly the same content share), and ``<node>``
is a fresh random name. The record says where the node serves what it verified::

    {"format": "ckptd.sharing/1", "address": "HOST:PORT", "node": "<node>",
     "started_at": <unix seconds>}

and is deleted when the node stops serving. A record whose node died stays until the
run's next shared restore of that slot reads it and finds it stale (``STALE_SECONDS``)
or the run is removed; a reader takes a record older than that, or one that does not
parse, for no one (it is never trusted for more than an address to ask: every request
to it is signed, every byte from it verified).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptd.core import checksum
from ckptd.repository import Repository, sharing_key

FORMAT = "ckptd.sharing/1"
RECORD_MAX_BYTES = 4096
#: A record older than this is a node that died restoring (a restore that shares keeps
#: serving for at most ``ckptd.peers.sharing.session.LINGER_MAX_SECONDS`` after it ends).
STALE_SECONDS = 6 * 3600.0
_NODE = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class Participant:
    node: str
    address: str
    started_at: float


def session_of(slot: str, identity: str) -> str:
    """The session name of a restore of ``slot`` whose manifest has ``identity``."""
    return f"{slot}.{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def new_node() -> str:
    return uuid.uuid4().hex[:16]


def announce(repo: Repository, run: str, session: str, me: Participant) -> str:
    """Write this node's record; returns its key (``withdraw`` deletes it)."""
    key = sharing_key(run, session, me.node)
    body = json.dumps(
        {"format": FORMAT, "address": me.address, "node": me.node, "started_at": me.started_at}
    ).encode()
    repo.storage.put_bytes(key, body, crc32c=checksum.crc32c(body))
    return key


def withdraw(repo: Repository, key: str) -> None:
    repo.storage.delete([key])


def is_address(text: str) -> bool:
    """Whether ``text`` is a ``host:port`` a participant may be asked at."""
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and len(text) <= 300


def parse_record(body: bytes) -> Participant | None:
    """The participant a record names, or None when it is no record of this format."""
    if len(body) > RECORD_MAX_BYTES:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    node, address, started = doc.get("node"), doc.get("address"), doc.get("started_at")
    if not (isinstance(node, str) and _NODE.match(node) and isinstance(address, str)):
        return None
    if not is_address(address) or not isinstance(started, int | float):
        return None
    return Participant(node, address, float(started))


def participants(repo: Repository, run: str, session: str, *, now: float) -> list[Participant]:
    """Every fresh record of ``session``, oldest first (read 16 at a time)."""
    listed = [
        info.key
        for info in repo.storage.list_objects(sharing_key(run, session))
        if info.size <= RECORD_MAX_BYTES
    ]
    if not listed:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(listed))) as pool:
        bodies = list(pool.map(repo.get_or_none, listed))
    found = [parse_record(b) for b in bodies if b is not None]
    fresh = [p for p in found if p is not None and now - p.started_at <= STALE_SECONDS]
    return sorted(fresh, key=lambda p: (p.started_at, p.node))


__all__ = [
    "FORMAT",
    "STALE_SECONDS",
    "Participant",
    "announce",
    "is_address",
    "new_node",
    "parse_record",
    "participants",
    "session_of",
    "withdraw",
]
