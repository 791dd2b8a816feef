"""A stand-in for nvidia-ml-py's ``pynvml`` where no GPU can be reached: the same names,
answering from a JSON file the test writes (``$NVML_STANDIN_STATE``), read at every
call so a test changes a GPU between polls. Put this directory first on ``PYTHONPATH``.

Names and constants as nvidia-ml-py defines them from nvml.h:
``NVML_MEMORY_ERROR_TYPE_UNCORRECTED`` = 1, ``NVML_VOLATILE_ECC`` = 0,
``NVML_PERF_POLICY_POWER`` = 0, ``NVML_PERF_POLICY_THERMAL`` = 1,
``NVML_TEMPERATURE_GPU`` = 0; ``nvmlDeviceGetRemappedRows`` answers
``(corrRows, uncRows, isPending, failureOccurred)``; ``nvmlDeviceGetViolationStatus`` a
``c_nvmlViolationTime_t`` (``referenceTime``, ``violationTime`` in ns); an unsupported
query raises ``NVMLError`` (here ``NVMLError_NotSupported``, as its subclass).

The state: ``{"init_error": "Driver Not Loaded" | null, "gpus": [{"uuid", "dbe",
"remapped": [corr, unc, pending, failure], "thermal_ns", "power_ns", "temperature"}]}``;
a field that is null is a query the GPU does not support.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PERF_POLICY_POWER = 0
NVML_PERF_POLICY_THERMAL = 1
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    """nvidia-ml-py's error type."""


class NVMLError_NotSupported(NVMLError):  # nvidia-ml-py spells it so
    """The query is not supported by this GPU."""


@dataclass
class c_nvmlViolationTime_t:  # nvidia-ml-py spells it so
    referenceTime: int
    violationTime: int


def _state() -> dict[str, Any]:
    with open(os.environ["NVML_STANDIN_STATE"]) as f:
        return dict(json.load(f))


def _gpu(handle: int) -> dict[str, Any]:
    return dict(_state()["gpus"][handle])


def _field(handle: int, name: str) -> Any:
    value = _gpu(handle).get(name)
    if value is None:
        raise NVMLError_NotSupported("Not Supported")
    return value


def nvmlInit() -> None:
    error = _state().get("init_error")
    if error:
        raise NVMLError(error)


def nvmlShutdown() -> None:
    return None


def nvmlDeviceGetCount() -> int:
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError("Invalid Argument")
    return index


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_field(handle, "uuid"))


def nvmlDeviceGetTotalEccErrors(handle: int, error_type: int, counter_type: int) -> int:
    if counter_type != NVML_VOLATILE_ECC:
        raise NVMLError_NotSupported("Not Supported")
    if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED:
        return int(_field(handle, "sbe"))
    if error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
        return int(_field(handle, "dbe"))
    raise NVMLError_NotSupported("Not Supported")


def nvmlDeviceGetRemappedRows(handle: int) -> tuple[int, int, int, int]:
    corr, unc, pending, failure = _field(handle, "remapped")
    return int(corr), int(unc), int(pending), int(failure)


def nvmlDeviceGetViolationStatus(handle: int, policy: int) -> c_nvmlViolationTime_t:
    name = {NVML_PERF_POLICY_THERMAL: "thermal_ns", NVML_PERF_POLICY_POWER: "power_ns"}[policy]
    return c_nvmlViolationTime_t(0, int(_field(handle, name)))


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    return int(_field(handle, "temperature"))
