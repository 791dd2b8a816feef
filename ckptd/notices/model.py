"""The one event type every notice source produces, and the interface they share.

As in aws-node-termination-handler (one monitor per source, one ``InterruptionEvent``),
each cloud has its own source module, and all of them yield :class:`Notice`. The
responder (signal the trainer, emergency flush) consumes Notices and knows no cloud.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ckptd.notices.health import SourceHealth

#: Where a notice came from. "drill" is ``ckptd drill`` (a simulated preemption).
NoticeSourceName = Literal["aws", "gcp", "azure", "sigterm", "slurm", "drill"]

#: What the notice announces. Sources may add kinds; consumers must accept unknown ones.
KNOWN_KINDS: frozenset[str] = frozenset(
    {
        "spot-termination",  # AWS spot instance-action "terminate"
        "spot-stop",  # AWS spot instance-action "stop"
        "spot-hibernate",  # AWS spot instance-action "hibernate"
        "rebalance",  # AWS rebalance recommendation (elevated risk; no deadline)
        "maintenance",  # AWS scheduled event / GCP maintenance-event
        "preemption",  # GCP preempted=TRUE / Azure Preempt
        "terminate",  # Azure Terminate
        "reboot",  # Azure Reboot
        "redeploy",  # Azure Redeploy
        "freeze",  # Azure Freeze
        "sigterm",  # our own SIGTERM (Kubernetes pod termination)
        "time-limit",  # Slurm: the job's end is near (ckptd.notices.slurm)
        "user-signal",  # Slurm: sbatch --signal / scancel --signal
        "drill",  # ckptd drill
    }
)

Clock = Callable[[], datetime]
Sleep = Callable[[float], Awaitable[None]]


def utc_now() -> datetime:
    """The default clock: an aware datetime in UTC."""
    return datetime.now(UTC)


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with a ``Z`` suffix and millisecond precision."""
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(value: str) -> datetime:
    """Parse an RFC 3339 / ISO 8601 time; a naive value is taken as UTC."""
    parsed = datetime.fromisoformat(value.strip())
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Notice:
    """One preemption, interruption or maintenance notice.

    ``id`` is the dedupe key, stable across polls (and, where the cloud allows, across
    restarts): what the instance is told to do, never when: the AWS spot action (or the
    scheduled event's EventId), the Azure EventId, GCP's preempted or maintenance state,
    with a count of appearances where an item can go and come back.
    A source that reads the same id with another deadline yields it again: an update of
    that notice's deadline, never a second notice.
    ``cancelled`` is True on a follow-up notice saying that an earlier one (same id)
    went away, e.g. an Azure event removed from the document before it started.
    """

    source: str
    kind: str
    id: str
    noticed_at: datetime
    deadline: datetime | None = None
    detail: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    cancelled: bool = False

    def __post_init__(self) -> None:
        # Naive datetimes are a bug waiting to happen across hosts and the trainer.
        if self.noticed_at.tzinfo is None:
            raise ValueError("Notice.noticed_at must be timezone-aware")
        if self.deadline is not None and self.deadline.tzinfo is None:
            raise ValueError("Notice.deadline must be timezone-aware")

    def seconds_left(self, now: datetime) -> float | None:
        """Seconds from ``now`` to the deadline (negative once past), None if unknown."""
        if self.deadline is None:
            return None
        return (self.deadline - now).total_seconds()

    def to_json(self) -> dict[str, Any]:
        """The contract shape ``{"source", "kind", "deadline", "noticed_at"}`` plus extras.

        ``deadline`` and ``noticed_at`` are RFC 3339 strings in UTC (``deadline`` may be
        null); the extras are ``id``, ``cancelled`` and ``detail``.
        """
        return {
            "source": self.source,
            "kind": self.kind,
            "deadline": format_time(self.deadline) if self.deadline is not None else None,
            "noticed_at": format_time(self.noticed_at),
            "id": self.id,
            "cancelled": self.cancelled,
            "detail": dict(self.detail),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Notice:
        """Inverse of :meth:`to_json` (extras optional)."""
        deadline = data.get("deadline")
        return cls(
            source=str(data["source"]),
            kind=str(data["kind"]),
            id=str(data.get("id") or f"{data['source']}:{data['kind']}:{data['noticed_at']}"),
            noticed_at=parse_time(str(data["noticed_at"])),
            deadline=parse_time(str(deadline)) if deadline else None,
            detail=dict(data.get("detail") or {}),
            cancelled=bool(data.get("cancelled", False)),
        )


@runtime_checkable
class NoticeSource(Protocol):
    """A watcher of one notice channel (one cloud's metadata service, or a signal).

    ``watch()`` is an async generator: it yields each new notice once (deduplicated by
    ``Notice.id`` inside the source; again only when its deadline moved), never raises on a bad response (garbage, 5xx,
    timeouts, refused connections, a response that is not from the metadata service):
    it logs those at warning level, rate-limited, and keeps polling. It ends only when
    cancelled or closed (``aclose()``). Construction does no I/O.
    """

    name: str

    def watch(self) -> AsyncIterator[Notice]:
        """Yield notices as they appear, until cancelled."""
        ...

    async def acknowledge(self, notice: Notice) -> None:
        """Tell the cloud we are ready (Azure StartRequests); a no-op elsewhere."""
        ...


class RateLimitedLog:
    """Warnings that repeat every poll, logged once per ``interval`` per key.

    A metadata endpoint that is down answers the same error every second; logging each
    one buries everything else. Per key (one endpoint, say) the first warning is logged
    at once, and so is one whose event or error differs from the last; a repeat is logged at most
    every ``interval`` seconds, with the count suppressed in between. The first success
    after a failure is logged at info level, so the outage has an end in the log.
    """

    def __init__(
        self,
        logger: Any,
        interval: float = 60.0,
        monotonic: Callable[[], float] = time.monotonic,
        health: SourceHealth | None = None,
    ) -> None:
        self._health = health  # told of every failure and success, logged or not
        self._log = logger
        self._interval = interval
        self._monotonic = monotonic
        self._last: dict[str, tuple[float, str]] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, event: str, **kw: Any) -> None:
        """Log ``event`` unless ``key`` logged the same event less than ``interval`` ago."""
        if self._health is not None:
            self._health.failed(key, str(kw.get("error") or event))
        now = self._monotonic()
        last = self._last.get(key)
        # A new cause (403 after a timeout, say) is news, however soon it comes.
        what = f"{event}\0{kw.get('error', '')}"
        if last is not None and last[1] == what and now - last[0] < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        suppressed = self._suppressed.pop(key, 0)
        self._last[key] = (now, what)
        if suppressed:
            kw["suppressed"] = suppressed
        self._log.warning(event, endpoint=key, **kw)

    def recovered(self, key: str, event: str, **kw: Any) -> None:
        """Log ``event`` at info level if ``key`` had been failing."""
        if self._health is not None:
            self._health.succeeded(key)
        if self._last.pop(key, None) is not None:
            suppressed = self._suppressed.pop(key, 0)
            self._log.info(event, endpoint=key, suppressed=suppressed, **kw)

    def failing(self, key: str) -> bool:
        """True while ``key`` has an unrecovered warning."""
        return key in self._last
