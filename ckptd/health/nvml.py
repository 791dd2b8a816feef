"""NVML (``nvidia-ml-py``'s ``pynvml``) read as GPU readings (``ckptd.health.gpu``), for a
node that runs no DCGM exporter.

Per GPU, the calls NVML documents (the NVML API reference, "Device Queries"):

- ``nvmlDeviceGetTotalEccErrors(h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)``:
  double-bit (uncorrectable) ECC errors since the driver loaded; with
  ``NVML_MEMORY_ERROR_TYPE_CORRECTED``, the single-bit (corrected) ones, whose rate is read;
- ``nvmlDeviceGetRemappedRows(h)``: (rows remapped for correctable errors, for
  uncorrectable ones, a remapping pending, a remapping failed);
- ``nvmlDeviceGetViolationStatus(h, NVML_PERF_POLICY_THERMAL | NVML_PERF_POLICY_POWER)``:
  ``violationTime``, nanoseconds throttled, a counter;
- ``nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)``; ``nvmlDeviceGetUUID(h)``.

A call a GPU does not support (``NVMLError``: ECC off, no row remapper before Ampere)
leaves that field unread. NVML has no "last Xid" query: the kernel log hears them.

Invariant: a reader never raises. No ``pynvml``, or no driver to load, is
``unreadable`` with the reason; ``nvmlInit`` is tried again at the next poll.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ckptd.core.extras import install_hint
from ckptd.health.gpu import GpuReading

INSTALL = "pip install nvidia-ml-py"
# Why the source cannot be read without the module: one line, what to install or set.
MISSING = f"nvidia-ml-py is not installed: {install_hint('nvml')}; or set [health] nvml = false"


class NvmlReader:
    """One ``nvmlInit`` for the daemon's life, then every GPU read at each poll."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.unreadable: str | None = None

    def _init(self) -> bool:
        if self.nvml is not None:
            return True
        try:
            nvml: Any = importlib.import_module("pynvml")
        except ImportError:
            self.unreadable = MISSING
            return False
        try:
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError: no driver, no GPU
            self.unreadable = f"nvmlInit failed: {exc}"
            return False
        self.nvml, self.unreadable = nvml, None
        return True

    def readings(self) -> list[GpuReading]:
        """Every GPU's reading now; [] with ``unreadable`` set when NVML cannot be read."""
        if not self._init():
            return []
        nvml = self.nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
            return [self._read(nvml, index) for index in range(count)]
        except Exception as exc:  # noqa: BLE001 - NVMLError: a GPU gone, the driver lost
            self.unreadable = f"NVML: {exc}"
            return []

    def _read(self, nvml: Any, index: int) -> GpuReading:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)

        def ask(call: Callable[[], Any]) -> Any:
            try:
                return call()
            except Exception:  # noqa: BLE001 - NVMLError_NotSupported and the like
                return None

        rows = ask(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        thermal = ask(
            lambda: nvml.nvmlDeviceGetViolationStatus(handle, nvml.NVML_PERF_POLICY_THERMAL)
        )
        power = ask(lambda: nvml.nvmlDeviceGetViolationStatus(handle, nvml.NVML_PERF_POLICY_POWER))
        uuid = ask(lambda: nvml.nvmlDeviceGetUUID(handle))
        return GpuReading(
            gpu=str(index),
            uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid or ""),
            dbe_total=_number(
                ask(
                    lambda: nvml.nvmlDeviceGetTotalEccErrors(
                        handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                    )
                )
            ),
            sbe_total=_number(
                ask(
                    lambda: nvml.nvmlDeviceGetTotalEccErrors(
                        handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC
                    )
                )
            ),
            remapped_uncorrectable=_number(rows[1]) if rows else None,
            remap_pending=_number(rows[2]) if rows else None,
            remap_failure=_number(rows[3]) if rows else None,
            # violationTime is in ns; the readings count microseconds, as DCGM's fields do.
            thermal_throttle_us=_ns_to_us(thermal),
            power_throttle_us=_ns_to_us(power),
            temperature_c=_number(
                ask(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            ),
        )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float | bool) else None


def _ns_to_us(status: Any) -> float | None:
    value = getattr(status, "violationTime", None)
    return float(value) / 1000.0 if isinstance(value, int | float) else None
