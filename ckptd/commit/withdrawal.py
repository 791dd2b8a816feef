"""Withdrawing an uncommitted slot: what makes deleting beside a live writer safe (I1
against deleters, in ``ckptd.commit.slots``).

A slot's objects may be deleted while it holds no manifest only once a *withdrawal* stands
at its manifest key. The withdrawal is written create-only, the very write a writer
commits with, so exactly one of the two wins:

- the withdrawal: no manifest can ever follow it; the writer's commit is refused
  (``ckptd.commit.single.SlotWithdrawnError``, a conflict: said loudly, its local copy kept), and every
  object of the slot may go;
- the manifest: the slot is committed, and is not deleted as an uncommitted one.

So no deleter (``ckptd rm``, ``ckptd prune``, retention on any node or tier, a redirect's
takeover) can leave a committed manifest over a hole, at any instant, whatever is killed
when. It costs a writer nothing (its commit was a create-only write already); a deleter one
create-only PUT per uncommitted slot it deletes.

Which uncommitted slots a deleter leaves alone is a matter of not wasting a writer's work,
not of safety: a slot is *in flight* while its claim is younger than
``CLAIM_LIVE_SECONDS`` (``in_flight``); ``rm`` refuses one without ``--force`` and
retention never withdraws one. A withdrawal stays after the slot's other objects go, for
``WITHDRAWAL_TTL_SECONDS``: a writer still uploading into the slot meets it at its commit
point. Retention removes a withdrawal older than that once nothing else is left in its
slot. While it stands, the name's slot cannot be committed: a re-save of that name on
the same trajectory within the hour is refused as a conflict (its local copy kept).

A redirect (``ckptd.commit.slots``) whose slot holds no manifest is a commit cut short
between two writes. The owner of the canonical slot it stands in (and only it: nothing
else ever deletes a redirect that is not a commit) waits ``REDIRECT_GRACE_SECONDS`` for
that manifest, then withdraws the redirect's slot and, once the withdrawal stands, removes
the redirect and commits its own content (``take_back``). A redirect therefore blocks a
name for seconds, never for good.

Blocking: run it in a thread.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.commit.slots import Claim, Redirect, Withdrawal, parse_claim, parse_withdrawal
from ckptd.core.manifest import ManifestError, epoch_of_timestamp, utc_timestamp
from ckptd.repository import Repository, claim_key, manifest_key, redirect_target
from ckptd.storage.base import PreconditionFailedError

#: How long after its claim a slot without a manifest counts as being uploaded.
CLAIM_LIVE_SECONDS = 3600.0
#: How long a withdrawal outlives the rest of its slot: as long as a claim counts as live,
#: since a writer that has not committed by then is taken for gone by every deleter (one
#: paused longer between its last upload and its commit could commit over a hole).
WITHDRAWAL_TTL_SECONDS = CLAIM_LIVE_SECONDS
#: How long the owner of a canonical slot waits for a redirect's manifest before taking
#: the name back (a healthy writer writes it one request after the redirect).
REDIRECT_GRACE_SECONDS = 10.0
_POLL_SECONDS = 0.25


def described(withdrawal: Withdrawal) -> dict[str, object]:
    """A withdrawal as a conflict's warning and ``ckptd status`` name it."""
    return {
        "slot": withdrawal.checkpoint,
        "withdrawn_by": withdrawal.by,
        "host": withdrawal.host,
        "withdrawn_at": withdrawal.withdrawn_at,
        "reason": withdrawal.reason,
    }


@dataclass(frozen=True)
class InFlight:
    """A slot's writer as its claim names it, and how long ago it claimed (seconds)."""

    claim: Claim | None  # None: a claim that does not parse (another version's)
    age: float

    def who(self) -> str:
        """The writer for a refusal: host, node and the claim's age."""
        if self.claim is None:
            return f"a writer of another ckptd version (claimed {self.age:.0f} s ago)"
        node = f", node {self.claim.node_rank}" if self.claim.node_rank is not None else ""
        return f"{self.claim.host}{node} (writer {self.claim.writer}, claimed {self.age:.0f} s ago)"


def claim_of(repo: Repository, run: str, slot: str, now: float) -> InFlight | None:
    """The slot's claim and its age, or None when it has none."""
    key = claim_key(run, slot)
    body = repo.get_or_none(key)
    if body is None:
        return None
    try:
        claim: Claim | None = parse_claim(body)
    except ManifestError:
        claim = None
    when = epoch_of_timestamp(claim.claimed_at) if claim is not None else None
    if when is None:
        info = repo.storage.head(key)
        when = info.modified if info is not None and info.modified > 0 else now
    return InFlight(claim, max(0.0, now - when))


def in_flight(
    repo: Repository, run: str, slot: str, now: float, live_seconds: float = CLAIM_LIVE_SECONDS
) -> InFlight | None:
    """The writer uploading into ``slot`` now, as far as the store tells: its claim when
    younger than ``live_seconds``; None for no claim or an older one. The caller knows the
    slot holds no manifest."""
    found = claim_of(repo, run, slot, now)
    return found if found is not None and found.age < live_seconds else None


def withdraw(
    repo: Repository,
    run: str,
    slot: str,
    *,
    by: str,
    reason: str,
    now: float,
    writer: str | None = None,
) -> Withdrawal | None:
    """Make ``slot`` uncommittable before deleting any of its objects (module doc): the
    withdrawal standing at its manifest key (written now, or before); None when a
    manifest, a redirect or anything else holds that key: the slot is then not to be
    deleted as an uncommitted one."""
    withdrawal = Withdrawal(
        run_id=run,
        checkpoint=slot,
        by=by,
        host=socket.gethostname(),
        withdrawn_at=utc_timestamp(now),
        reason=reason,
        writer=writer,
    )
    try:
        repo.put_if_absent(manifest_key(run, slot), withdrawal.to_bytes(), "withdraw a slot")
        return withdrawal
    except PreconditionFailedError:
        body = repo.get_or_none(manifest_key(run, slot))
    return parse_withdrawal(body) if body is not None else None


def withdrawal_at(repo: Repository, run: str, slot: str) -> Withdrawal | None:
    """The withdrawal at ``slot``'s manifest key, if one stands there."""
    body = repo.get_or_none(manifest_key(run, slot))
    return parse_withdrawal(body) if body is not None else None


def take_back(
    repo: Repository,
    run: str,
    canonical: str,
    redirect: Redirect,
    *,
    by: str,
    now: float,
    wait_seconds: float = REDIRECT_GRACE_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> bool:
    """The owner of ``canonical`` takes its name back from ``redirect``, a commit cut short
    (module doc): whether the redirect is gone. False when the redirect's manifest is (or
    becomes) there within ``wait_seconds``: that content is committed."""
    deadline = monotonic() + wait_seconds
    while withdrawal_at(repo, run, redirect.to) is None:
        try:
            if repo.read_manifest(run, redirect.to) is not None:
                return False
        except ManifestError:
            return False  # something is there that is not ours to judge: keep off
        if monotonic() >= deadline:
            break
        sleep(_POLL_SECONDS)
    reason = (
        f"its redirect at {run}/{canonical} was not followed by a manifest within "
        f"{wait_seconds:.0f} s"
    )
    if (
        withdraw(repo, run, redirect.to, by=by, reason=reason, now=now, writer=redirect.writer)
        is None
    ):
        return False  # its manifest won the key: committed
    key = manifest_key(run, canonical)
    body = repo.get_or_none(key)
    if body is not None and redirect_target(body) == redirect.to:
        # Only the canonical slot's owner removes a redirect that is no commit: nothing
        # else writes this key while the redirect stands, so it is still the one read.
        repo.delete([key])
    return True


__all__ = [
    "CLAIM_LIVE_SECONDS",
    "REDIRECT_GRACE_SECONDS",
    "WITHDRAWAL_TTL_SECONDS",
    "InFlight",
    "claim_of",
    "described",
    "in_flight",
    "take_back",
    "withdraw",
    "withdrawal_at",
]
