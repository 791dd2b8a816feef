"""When a holder no longer counts: it stopped answering, or it has a notice of its own.

Pure: times are arguments. The bounds live here, in one place (docs/peers.md,
"Holders that go away", and docs/design.md "Peer replication" quote them):

- ``CONNECT_SECONDS``: a connection to a holder that is not made within this is a
  failed request (a vanished host's address answers no ARP; a silently dropped SYN
  waits for this);
- ``STALL_SECONDS``: a holder that answered nothing for this long (no chunk taken, no
  hello answered), or that took no chunk for this long while chunks were in flight to
  it, is **abandoned**: the push to it ends there and then (``peer_push_abandoned``)
  and the next candidate takes over at once;
- ``PROBE_SECONDS``: during a push, and after it while the part is not in the store,
  each holder is asked ``/v1/peer/hello`` this often: the answer says whether it is
  alive, and whether it has a notice (then it is dropped at once).

So a holder that dies mid-push is replaced at most ``REPLACED_WITHIN_SECONDS`` after its
last answer (the stall, plus one watch tick), well inside a 30 s notice.

The invariant ``Liveness`` keeps: ``stalled`` names a reason only if, for the last
``STALL_SECONDS``, the holder answered no request at all, or chunks were in flight to
it the whole time and none was taken. Time spent waiting on the pace (``pacing``) or
in a retry's backoff has no request in flight, so a slow, paced push is never taken
for a stalled one.
"""

from __future__ import annotations

from dataclasses import dataclass

CONNECT_SECONDS = 2.0
STALL_SECONDS = 4.0
PROBE_SECONDS = 1.0
#: How often a push's watch looks at its holder.
WATCH_TICK_SECONDS = 0.25
#: A holder that stops answering is replaced at most this long after its last answer.
REPLACED_WITHIN_SECONDS = STALL_SECONDS + WATCH_TICK_SECONDS
#: A notice without a deadline (a rebalance recommendation) keeps its node from holding
#: others' parts this long after it was noticed.
UNBOUNDED_NOTICE_SECONDS = 120.0


@dataclass
class Liveness:
    """One push's view of its holder (module doc). ``started`` is monotonic seconds."""

    started: float
    stall: float = STALL_SECONDS
    answered: float | None = None  # the last answer of any request (a hello included)
    chunks_in_flight: int = 0
    moved: float | None = None  # the last chunk taken, or chunks began to be in flight
    notice: bool = False  # the holder said it has a notice

    def chunk_sent(self, now: float) -> None:
        if self.chunks_in_flight == 0:
            self.moved = max(self.moved or now, now)
        self.chunks_in_flight += 1

    def chunk_ended(self, now: float, taken: bool) -> None:
        """A chunk's request ended: ``taken`` when the holder answered 200."""
        self.chunks_in_flight = max(0, self.chunks_in_flight - 1)
        if taken:
            self.moved = now

    def heard(self, now: float, *, notice: bool = False) -> None:
        """The holder answered a request (any status: it is there)."""
        self.answered = now
        self.notice = self.notice or notice

    def stalled(self, now: float) -> str | None:
        """Why the holder no longer counts ("notice", "silent", "stalled"), or None."""
        if self.notice:
            return "notice"
        if now - max(self.answered or self.started, self.started) > self.stall:
            return "silent"
        if self.chunks_in_flight and self.moved is not None and now - self.moved > self.stall:
            return "stalled"
        return None


__all__ = [
    "CONNECT_SECONDS",
    "PROBE_SECONDS",
    "REPLACED_WITHIN_SECONDS",
    "STALL_SECONDS",
    "UNBOUNDED_NOTICE_SECONDS",
    "WATCH_TICK_SECONDS",
    "Liveness",
]
