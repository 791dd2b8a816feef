"""Who holds and who fetches each file of a shared restore, and where a file is read from.

Pure: one restore's sharing as this node sees it, with the time passed in; no I/O, no
clock, no lock (``ckptd.peers.sharing.session`` holds the lock and does the polling).

Files are numbered by their place in the manifest. Every node restoring the same
checkpoint fetches from the store only what no other node has or is fetching, and reads
the rest from a node that has it (``source``):

1. a file some live participant has *verified* (held to the manifest's size and CRC-32C,
   on its disk) is read from one of them, picked by the file's number so that readers
   spread over the holders;
2. a file this node claimed (it is fetching it from the store) is fetched from the store;
3. a file no live participant claims, or whose claimer has made no progress on it for
   ``stall_seconds``, is claimed by this node and fetched from the store, unless what this
   node has claimed and not yet verified would then pass its share of the checkpoint
   (its bytes over the live participants, or over ``expected``, the run's nodes, when
   more): then it waits for its claims to verify. Nor
   does it claim while a live participant it knows of has not answered once yet: a node
   that starts beside others claims nothing they hold or claim before it has heard them
   (a poll's answer, milliseconds), and one alone (none known) claims at once. So nodes
   that start together, each at its own place in the checkpoint, claim apart;
4. else (another node is fetching it, and moving) this node waits for that node.

A participant is gone once its port refused ``GONE_AFTER_REFUSALS`` polls in a row (its
process died) or none of its polls was answered for ``SILENT_SECONDS`` (its host
vanished, or its packets are dropped): its claims are void and nothing is read from it.
A slow answer is no death: a node busy on a loaded machine stays live. One that served a file that did not verify,
or failed a read, is *bad*: likewise. Two nodes that have not yet seen each other's
claims may both fetch a file: that costs store egress, never a wrong byte, since every
node verifies every file it keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: Polls in a row refused before a participant counts as gone (its process died).
GONE_AFTER_REFUSALS = 2
#: No poll answered for this long: gone (its host vanished, or its packets are dropped).
SILENT_SECONDS = 5.0

Decision = tuple[Literal["peer", "store", "wait"], str]
"""``("peer", address)``, ``("store", "")`` or ``("wait", "")`` (module doc)."""


@dataclass
class Seen:
    """One other participant, as its last answers said."""

    verified: frozenset[int] = frozenset()
    claims: dict[int, int] = field(default_factory=dict)  # file -> bytes fetched
    moved_at: dict[int, float] = field(default_factory=dict)  # file -> its bytes last grew
    done: bool = False
    heard: bool = False  # it answered a poll at least once
    refusals: int = 0  # polls in a row its port refused
    answered_at: float = 0.0  # its last answer (or when it was met)
    progress_at: float = 0.0  # when its verified files or claimed bytes last grew


def ranges_of(numbers: Iterable[int]) -> list[list[int]]:
    """``[[first, last], ...]`` (inclusive) covering ``numbers``, ascending."""
    out: list[list[int]] = []
    for n in sorted(set(numbers)):
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return out


def parse_state(doc: Any, files: int) -> tuple[frozenset[int], dict[int, int], bool]:
    """``(verified, claims, done)`` from a participant's state document; ValueError when
    it is not one, or names a file the manifest does not have."""
    if not isinstance(doc, Mapping):
        raise ValueError("a state must be a JSON object")
    verified: set[int] = set()
    for pair in doc.get("verified", []):
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(n) is int for n in pair)):
            raise ValueError(f"verified: {pair!r} is not a [first, last] pair")
        first, last = pair
        if not 0 <= first <= last < files:
            raise ValueError(f"verified: {pair!r} is outside the manifest's {files} files")
        verified.update(range(first, last + 1))
    claims: dict[int, int] = {}
    raw = doc.get("claims", {})
    if not isinstance(raw, Mapping):
        raise ValueError("claims must be an object")
    for key, fetched in raw.items():
        number = int(key)
        if not 0 <= number < files or type(fetched) is not int or fetched < 0:
            raise ValueError(f"claims: {key!r}: {fetched!r} is not a file's bytes fetched")
        claims[number] = fetched
    done = doc.get("done", False)
    if not isinstance(done, bool):
        raise ValueError("done must be true or false")
    return frozenset(verified), claims, done


def fetch_order(sizes: Sequence[int], place: int, out_of: int) -> list[int]:
    """The order a node at ``place`` (of ``out_of``) fetches files of these ``sizes`` in,
    as their numbers: first its own stretch of their bytes, from the file holding byte
    ``total * place // out_of`` up to the next place's first file; then the others' files
    from the far end backward. A node done early so takes work from where the node
    before it will come last, not from where it works: two nodes meet once, in the
    middle of what is left, instead of racing for the same files until the end."""
    total = sum(sizes)

    def file_at(byte: int) -> int:
        seen = 0
        for number, size in enumerate(sizes):
            if seen + size > byte:
                return number
            seen += size
        return len(sizes)

    first = file_at(total * place // out_of)
    stop = file_at(total * (place + 1) // out_of) if place + 1 < out_of else len(sizes)
    numbers = list(range(len(sizes)))
    return [*numbers[first:stop], *reversed(numbers[:first]), *reversed(numbers[stop:])]


class ShareBoard:
    """One shared restore as this node sees it (module doc)."""

    def __init__(self, sizes: Sequence[int], *, stall_seconds: float) -> None:
        self.sizes = list(sizes)
        self.files = len(self.sizes)
        self.stall_seconds = stall_seconds
        self.expected = 1  # the run's nodes: a share is never more than theirs
        self.claims: dict[int, int] = {}  # this node's: file -> bytes fetched from the store
        self.verified: set[int] = set()
        self.done = False
        self.peers: dict[str, Seen] = {}
        self.bad: set[str] = set()
        # Grows with each change of what this node claims, verified or is done with: a
        # participant's poll waits for it to pass the one it saw (``document``).
        self.version = 0

    # -- what this node does ---------------------------------------------------------

    def fetched(self, number: int, nbytes: int) -> None:
        """``nbytes`` more of a claimed file came from the store."""
        self.claims[number] = self.claims.get(number, 0) + nbytes

    def release(self, number: int) -> None:
        """A claimed file's fetch failed: another node may take it at once."""
        self.claims.pop(number, None)
        self.version += 1

    def kept(self, number: int) -> None:
        """A file verified here (from wherever it came): others may read it from now on."""
        self.verified.add(number)
        self.claims.pop(number, None)
        self.version += 1

    def finished(self) -> None:
        self.done = True
        self.version += 1

    def document(self) -> dict[str, Any]:
        """What this node answers a participant's poll with (``parse_state``)."""
        return {
            "version": self.version,
            "verified": ranges_of(self.verified),
            "claims": {str(n): b for n, b in sorted(self.claims.items())},
            "done": self.done,
        }

    # -- what the others said ----------------------------------------------------------

    def join(self, address: str, now: float) -> None:
        self.peers.setdefault(address, Seen(answered_at=now, progress_at=now))

    def heard(self, address: str, doc: Any, now: float) -> None:
        """``address``'s poll answered ``doc`` (ValueError when it is no state)."""
        verified, claims, done = parse_state(doc, self.files)
        seen = self.peers.setdefault(address, Seen(answered_at=now, progress_at=now))
        if len(verified) > len(seen.verified):
            seen.progress_at = now
        moved = {
            n: (now if b > seen.claims.get(n, -1) else seen.moved_at.get(n, now))
            for n, b in claims.items()
        }
        if any(at == now for at in moved.values()):
            seen.progress_at = now
        seen.verified, seen.claims, seen.moved_at, seen.done = verified, claims, moved, done
        seen.refusals, seen.answered_at, seen.heard = 0, now, True

    def unanswered(self, address: str, now: float, *, refused: bool) -> None:
        """A poll of ``address`` failed: ``refused`` (its port is closed), or not
        answered in time (which alone is no death: ``SILENT_SECONDS``)."""
        seen = self.peers.setdefault(address, Seen(answered_at=now, progress_at=now))
        seen.refusals = seen.refusals + 1 if refused else 0

    def served_badly(self, address: str) -> None:
        """``address`` served a file that did not verify, or failed a read: never read
        from it again, and its claims are void."""
        self.bad.add(address)

    def live(self, address: str, now: float) -> bool:
        seen = self.peers.get(address)
        return (
            seen is not None
            and address not in self.bad
            and seen.refusals < GONE_AFTER_REFUSALS
            and now - seen.answered_at <= SILENT_SECONDS
        )

    # -- the decisions -----------------------------------------------------------------

    def source(self, number: int, now: float) -> Decision:
        """Where file ``number``'s next range comes from (module doc); claims it when
        the answer is the store and no one else holds a live claim."""
        holders = sorted(
            a for a, s in self.peers.items() if number in s.verified and self.live(a, now)
        )
        if holders:
            return ("peer", holders[number % len(holders)])
        if number in self.claims:
            return ("store", "")
        for address, seen in self.peers.items():
            moving = now - seen.moved_at.get(number, now) <= self.stall_seconds
            if number in seen.claims and self.live(address, now) and moving:
                return ("wait", "")
        live = [s for a, s in self.peers.items() if self.live(a, now)]
        if any(not s.heard for s in live):
            return ("wait", "")  # what it holds or claims is not known yet
        pending = sum(self.sizes[n] for n in self.claims)
        share = sum(self.sizes) / max(1 + len(live), self.expected)
        if self.claims and pending + self.sizes[number] > share:
            return ("wait", "")
        self.claims[number] = 0
        self.version += 1
        return ("store", "")

    def others_busy(self, now: float, idle_seconds: float) -> bool:
        """Whether a live participant is still restoring and has moved within
        ``idle_seconds`` (this node keeps serving it until none is)."""
        return any(
            self.live(a, now) and not s.done and now - s.progress_at <= idle_seconds
            for a, s in self.peers.items()
        )


__all__ = [
    "GONE_AFTER_REFUSALS",
    "SILENT_SECONDS",
    "Decision",
    "Seen",
    "ShareBoard",
    "fetch_order",
    "parse_state",
    "ranges_of",
]
