"""The fleet campaign's trace: which nodes a simulated spot cloud takes, when, and how.

A trace is a pure function of its seed (``random.Random(seed)``, nothing else): the same
seed and parameters give the same JSON, so every policy of a campaign plays the same
interruptions and a campaign is reproducible from its seed.

Times are *scaled seconds* from the campaign's start (the job's first step). ``scale`` is
scaled seconds per real-cloud second: at 0.1 an AWS 2-minute notice becomes 12 s and a
replacement that takes a cloud 2 minutes comes after 12 s. Only the cloud's times are
scaled (notice windows, replacement delays); the trainer's steps run at their real speed.

Kinds of event (the labels of a mix):

- ``aws``, ``gcp``, ``azure``: one node's preemption notice through that cloud's metadata
  protocol, the node taken ``window`` later (AWS 120 s, GCP and Azure 30 s, times scale);
- ``kill``: hardware: one node gone at ``at``, no notice (``window`` 0, ``provider`` None);
- ``reclaim``: a pool reclaimed at once: 2 to N-1 nodes, one notice each from one cloud
  (needs N >= 3: with fewer nodes its weight is ignored);
- ``whole``: every node of the job reclaimed at once with a notice (not in the default
  mix; only with it can an event leave no node standing).

The invariant every trace keeps (``violations`` checks it): events are in time order,
the first comes after ``min_gap``, and the next event comes only after the previous one's
replacement is due (``at + window + replace_after``) plus ``min_gap`` of productive
time, so the cluster is whole again before it is hit again; every event but ``whole``
leaves at least one node standing; the last replacement is due by ``duration``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

#: A cloud's notice window in real seconds (AWS spot: 2 minutes; GCP and Azure: 30 s).
WINDOWS = MappingProxyType({"aws": 120.0, "gcp": 30.0, "azure": 30.0})
PROVIDERS = tuple(WINDOWS)
#: Label -> weight; the labels are the kinds of event of the module docstring.
DEFAULT_MIX: Mapping[str, float] = MappingProxyType(
    {"aws": 3.0, "gcp": 2.0, "azure": 2.0, "kill": 2.0, "reclaim": 1.0}
)
LABELS = frozenset({*PROVIDERS, "kill", "reclaim", "whole"})
#: How long a cloud takes to bring up a replacement host, real seconds (drawn uniformly).
DEFAULT_REPLACE = (60.0, 180.0)


@dataclass(frozen=True)
class Event:
    """One interruption: a notice (the nodes go at ``at + window``) or a kill (gone at ``at``)."""

    at: float
    kind: str  # "notice" | "kill"
    nodes: tuple[int, ...]
    provider: str | None  # "aws" | "gcp" | "azure" for a notice, None for a kill
    window: float  # scaled seconds from the notice to the nodes going; 0 for a kill
    replace_after: float  # scaled seconds from the nodes going to their replacements' start

    @property
    def gone_at(self) -> float:
        """When the nodes are taken."""
        return self.at + self.window

    @property
    def replaced_at(self) -> float:
        """When the replacement hosts start (fresh disks, new addresses)."""
        return self.gone_at + self.replace_after

    @property
    def category(self) -> str:
        """What the figures count it as: ``reclaim`` (several nodes), ``notice`` or ``kill``."""
        return "reclaim" if len(self.nodes) > 1 else self.kind


@dataclass(frozen=True)
class Trace:
    """A campaign's interruptions, with the parameters that made them."""

    seed: int
    nodes: int
    scale: float
    duration: float
    events: tuple[Event, ...]

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): the same trace always gives the same text."""
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @staticmethod
    def from_json(s: str) -> Trace:
        """The trace ``to_json`` wrote."""
        raw = json.loads(s)
        events = tuple(
            Event(
                at=float(e["at"]),
                kind=str(e["kind"]),
                nodes=tuple(int(n) for n in e["nodes"]),
                provider=None if e["provider"] is None else str(e["provider"]),
                window=float(e["window"]),
                replace_after=float(e["replace_after"]),
            )
            for e in raw["events"]
        )
        return Trace(
            seed=int(raw["seed"]),
            nodes=int(raw["nodes"]),
            scale=float(raw["scale"]),
            duration=float(raw["duration"]),
            events=events,
        )


def _ms(seconds: float) -> float:
    # Millisecond precision keeps the JSON short and exactly round-trippable.
    return round(seconds, 3)


def _ms_after(seconds: float) -> float:
    # An event's time rounds up, never before the moment the invariant allows.
    return math.ceil(seconds * 1000 - 1e-6) / 1000


def _draw_event(
    rng: random.Random, label: str, at: float, nodes: int, scale: float, replace_after: float
) -> Event:
    if label == "kill":
        return Event(_ms_after(at), "kill", (rng.randrange(nodes),), None, 0.0, replace_after)
    taken: tuple[int, ...]
    if label in WINDOWS:
        provider, taken = label, (rng.randrange(nodes),)
    else:
        provider = rng.choice(PROVIDERS)
        size = nodes if label == "whole" else rng.randint(2, nodes - 1)
        taken = tuple(sorted(rng.sample(range(nodes), size)))
    return Event(
        _ms_after(at), "notice", taken, provider, _ms(WINDOWS[provider] * scale), replace_after
    )


def _usable(mix: Mapping[str, float], nodes: int) -> list[tuple[str, float]]:
    unknown = set(mix) - LABELS
    if unknown:
        raise ValueError(f"unknown kinds of event in the mix: {sorted(unknown)}")
    usable = [(k, w) for k, w in sorted(mix.items()) if w > 0 and (k != "reclaim" or nodes >= 3)]
    if not usable:
        raise ValueError(f"no kind of event in the mix can happen on {nodes} node(s)")
    return usable


def make_trace(
    seed: int,
    nodes: int = 4,
    *,
    scale: float,
    duration: float,
    events: int | None = None,
    mix: Mapping[str, float] = DEFAULT_MIX,
    min_gap: float = 30.0,
    replace: tuple[float, float] = DEFAULT_REPLACE,
) -> Trace:
    """A seeded trace over ``duration`` scaled seconds (module docstring).

    ``events`` None: as many as fit, each after its predecessor's replacement plus
    ``min_gap`` plus a random extra (exponential, mean ``min_gap``). ``events`` = n:
    exactly n, the spare time spread at random between them (ValueError if they cannot
    fit). ``replace`` is the range of replacement delays in real seconds.
    """
    if nodes < 1 or scale <= 0 or duration <= 0 or min_gap < 0:
        raise ValueError("nodes >= 1, scale > 0, duration > 0 and min_gap >= 0, please")
    rng = random.Random(seed)
    usable = _usable(mix, nodes)
    labels, weights = [k for k, _ in usable], [w for _, w in usable]

    def draw(at: float) -> Event:
        label = rng.choices(labels, weights)[0]
        delay = _ms(rng.uniform(*replace) * scale)
        return _draw_event(rng, label, at, nodes, scale, delay)

    out: list[Event] = []
    if events is None:
        at = min_gap + rng.expovariate(1 / min_gap) if min_gap > 0 else 0.0
        while True:
            event = draw(at)
            if event.replaced_at > duration:
                break
            out.append(event)
            at = event.replaced_at + min_gap + (rng.expovariate(1 / min_gap) if min_gap else 0)
    else:
        # Draw the events' shapes first, then place them with the spare time split at random.
        shapes = [draw(0.0) for _ in range(events)]
        busy = sum(e.window + e.replace_after for e in shapes) + min_gap * events
        spare = duration - busy - 0.001 * (events + 1)  # room for rounding each time up
        if spare < 0:
            raise ValueError(
                f"{events} events need {busy:.1f} scaled s, more than the duration {duration}"
            )
        cuts = sorted(rng.uniform(0, spare) for _ in range(events))
        at, used = min_gap, 0.0
        for shape, cut in zip(shapes, cuts, strict=True):
            at += cut - used
            used = cut
            placed = Event(
                _ms_after(at),
                shape.kind,
                shape.nodes,
                shape.provider,
                shape.window,
                shape.replace_after,
            )
            out.append(placed)
            at = placed.replaced_at + min_gap
    return Trace(seed, nodes, float(scale), float(duration), tuple(out))


def smoke_trace(seed: int, *, scale: float = 0.05, min_gap: float = 20.0) -> Trace:
    """The short CI trace: 2 nodes, a notice (cloud drawn from the seed), then a kill.

    At the default scale the notice window is 6 s (AWS) or 1.5 s (GCP, Azure) and each
    replacement comes 2-4 s after its node went.
    """
    rng = random.Random(seed)
    notice = _draw_event(
        rng, rng.choice(PROVIDERS), min_gap, 2, scale, _ms(rng.uniform(40, 80) * scale)
    )
    kill_at = notice.replaced_at + min_gap
    kill = _draw_event(rng, "kill", kill_at, 2, scale, _ms(rng.uniform(40, 80) * scale))
    return Trace(seed, 2, float(scale), _ms(kill.replaced_at + min_gap), (notice, kill))


def violations(trace: Trace, *, min_gap: float = 0.0) -> list[str]:
    """What in ``trace`` breaks the module's invariant (empty: none)."""
    found: list[str] = []
    ready = min_gap  # when the cluster is whole again and has had its productive gap
    for i, e in enumerate(trace.events):
        name = f"event {i} at {e.at}"
        if e.at < ready - 1e-6:
            found.append(f"{name} comes before the cluster is whole again plus the gap ({ready})")
        if not e.nodes or any(not 0 <= n < trace.nodes for n in e.nodes):
            found.append(f"{name} takes nodes outside 0..{trace.nodes - 1}: {e.nodes}")
        if len(set(e.nodes)) != len(e.nodes):
            found.append(f"{name} names a node twice: {e.nodes}")
        if e.kind == "kill" and (e.provider is not None or e.window != 0 or len(e.nodes) != 1):
            found.append(f"{name} is a kill with a provider, a window or several nodes")
        window = WINDOWS.get(e.provider or "")
        if e.kind == "notice" and (window is None or abs(e.window - window * trace.scale) > 1e-3):
            found.append(f"{name}: a notice's window is its cloud's, scaled ({e.provider})")
        if e.kind not in ("notice", "kill"):
            found.append(f"{name} is of no known kind: {e.kind}")
        if e.replace_after < 0:
            found.append(f"{name} is replaced before it goes")
        if e.replaced_at > trace.duration + 1e-6:
            found.append(f"{name} is replaced after the trace's end ({trace.duration})")
        ready = e.replaced_at + min_gap
    return found


def leaves_a_node(trace: Trace) -> bool:
    """Whether every event leaves at least one node standing (always, without ``whole``)."""
    return all(len(e.nodes) < trace.nodes for e in trace.events)
