"""A GPU's health readings, read as health events, whichever interface gave them (a DCGM
exporter's ``/metrics``, ``ckptd.health.dcgm``; NVML, ``ckptd.health.nvml``).

Each reading is one GPU at one poll: the last Xid, the double-bit ECC count, rows
remapped for uncorrectable errors and whether remapping failed, the time throttled for
heat and for power, the temperature. Counters mean something when they grow, so the
first reading of a GPU sets its baseline and is never an event.

- the last Xid changed to a code: ``xid-N``, its severity from ``ckptd.health.xid``;
- double-bit ECC errors or uncorrectable remapped rows grew: degrading (``ecc-dbe``,
  ``row-remap``);
- single-bit (corrected) ECC errors growing faster than ``corrected_per_minute`` between
  two polls: degrading, lasting (``ecc-sbe-rate``): corrected errors that climb are the
  warning a memory fault gives before it is uncorrectable, and the save is taken while
  the GPU still computes right;
- row remapping failed: degrading, lasting (``row-remap-failure``); a remapping pending
  (NVML): a warning, lasting (``row-remap-pending``);
- thermal or power throttling grew since the last poll, or the temperature is above
  the bound: a warning, lasting (``thermal-throttle``, ``power-throttle``,
  ``gpu-temperature``).

Invariant: pure. Readings and the time are arguments; the previous readings are this
object's state. A lasting condition's key names its GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.health.model import HealthEvent, Severity
from ckptd.health.xid import classify


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one poll; None where the interface did not say."""

    gpu: str  # the index, as the interface names it
    uuid: str = ""
    xid: int | None = None
    dbe_total: float | None = None
    sbe_total: float | None = None  # single-bit (corrected) ECC errors
    remapped_uncorrectable: float | None = None
    remap_failure: float | None = None
    remap_pending: float | None = None
    thermal_throttle_us: float | None = None
    power_throttle_us: float | None = None
    temperature_c: float | None = None


def _grew(now: float | None, before: float | None) -> float:
    return now - before if now is not None and before is not None and now > before else 0.0


class GpuWatch:
    """The previous reading of each GPU; ``events`` turns a poll's readings into events."""

    def __init__(
        self, source: str, temperature_bound: float, corrected_per_minute: float = 0.0
    ) -> None:
        self.source = source
        self.temperature_bound = temperature_bound
        self.corrected_per_minute = corrected_per_minute  # 0: no bound
        self.last: dict[str, GpuReading] = {}
        self.last_at: dict[str, float] = {}

    def events(self, readings: list[GpuReading], at: float) -> list[tuple[str, HealthEvent]]:
        """(key, event) per fault (key "") and per lasting condition (its key)."""
        found: list[tuple[str, HealthEvent]] = []
        for now in readings:
            before, since = self.last.get(now.gpu), self.last_at.get(now.gpu)
            self.last[now.gpu], self.last_at[now.gpu] = now, at
            if before is not None and since is not None:
                found += self._compare(before, now, at, at - since)
        return found

    def _corrected_rate(self, before: GpuReading, now: GpuReading, seconds: float) -> float:
        """Corrected ECC errors a minute between the two polls (0 without both counts)."""
        grew = _grew(now.sbe_total, before.sbe_total)
        return grew * 60.0 / seconds if grew and seconds > 0 else 0.0

    def _event(
        self,
        now: GpuReading,
        kind: str,
        severity: Severity,
        message: str,
        at: float,
        **detail: object,
    ) -> HealthEvent:
        return HealthEvent(
            self.source,
            kind,
            severity,
            f"GPU {now.gpu}: {message}",
            at,
            {"gpu": now.gpu, "uuid": now.uuid, **detail},
        )

    def _compare(
        self, before: GpuReading, now: GpuReading, at: float, seconds: float
    ) -> list[tuple[str, HealthEvent]]:
        found: list[tuple[str, HealthEvent]] = []
        if now.xid and now.xid != before.xid:
            entry = classify(now.xid)
            found.append(
                (
                    "",
                    self._event(
                        now,
                        f"xid-{entry.code}",
                        entry.severity,
                        f"Xid {entry.code}, {entry.meaning}",
                        at,
                        xid=entry.code,
                    ),
                )
            )
        if dbe := _grew(now.dbe_total, before.dbe_total):
            found.append(
                (
                    "",
                    self._event(
                        now, "ecc-dbe", "degrading", f"{dbe:g} new double-bit ECC error(s)", at
                    ),
                )
            )
        if rows := _grew(now.remapped_uncorrectable, before.remapped_uncorrectable):
            found.append(
                (
                    "",
                    self._event(
                        now,
                        "row-remap",
                        "degrading",
                        f"{rows:g} row(s) remapped for uncorrectable errors",
                        at,
                    ),
                )
            )
        rate = self._corrected_rate(before, now, seconds)
        lasting = [
            (
                "ecc-sbe-rate",
                "degrading",
                bool(self.corrected_per_minute) and rate > self.corrected_per_minute,
                f"{rate:.0f} corrected ECC errors a minute, above {self.corrected_per_minute:g}",
            ),
            ("row-remap-failure", "degrading", bool(now.remap_failure), "row remapping failed"),
            (
                "row-remap-pending",
                "warning",
                bool(now.remap_pending),
                "a row remapping is pending: it takes effect at the GPU's next reset",
            ),
            (
                "thermal-throttle",
                "warning",
                bool(_grew(now.thermal_throttle_us, before.thermal_throttle_us)),
                "throttled for heat since the last poll",
            ),
            (
                "power-throttle",
                "warning",
                bool(_grew(now.power_throttle_us, before.power_throttle_us)),
                "throttled for power since the last poll",
            ),
            (
                "gpu-temperature",
                "warning",
                now.temperature_c is not None and now.temperature_c > self.temperature_bound,
                f"{now.temperature_c} C, above {self.temperature_bound:g} C",
            ),
        ]
        for kind, severity, holds, message in lasting:
            if holds:
                key = f"{self.source}:{kind}:{now.gpu}"
                found.append((key, self._event(now, kind, severity, message, at)))  # type: ignore[arg-type]
        return found
