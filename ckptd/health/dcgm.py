"""A DCGM exporter's ``/metrics``, read as GPU readings (``ckptd.health.gpu``).

The names are dcgm-exporter's (its ``etc/default-counters.csv``: one line per DCGM field,
the Prometheus type and help), each sample labelled with the GPU's index ``gpu`` and its
``UUID``::

    DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-..."} 79           value of the last Xid
    DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{...} 0                         double-bit ECC errors
    DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{...} 0               rows remapped (uncorrectable)
    DCGM_FI_DEV_ROW_REMAP_FAILURE{...} 0                         whether remapping failed
    DCGM_FI_DEV_THERMAL_VIOLATION{...} 0                         us throttled for heat
    DCGM_FI_DEV_POWER_VIOLATION{...} 0                           us throttled for power
    DCGM_FI_DEV_GPU_TEMP{...} 41                                 temperature, C

(The ECC and violation fields are commented out of the default counters: an exporter
run with them enabled reports them; absent, they are not read.)

Invariant: pure; text in, readings out. What does not parse is no reading, never an
error.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ckptd.health.gpu import GpuReading

FIELDS = {
    "DCGM_FI_DEV_XID_ERRORS": "xid",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "dbe_total",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "sbe_total",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "remapped_uncorrectable",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "remap_failure",
    "DCGM_FI_DEV_THERMAL_VIOLATION": "thermal_throttle_us",
    "DCGM_FI_DEV_POWER_VIOLATION": "power_throttle_us",
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
}


def parse_exporter(text: str) -> list[GpuReading]:
    """One reading per GPU named in ``text``, in the order first seen."""
    values: dict[str, dict[str, object]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = FIELDS.get(sample.name) or FIELDS.get(sample.name.removesuffix("_total"))
                gpu = sample.labels.get("gpu")
                if field is None or gpu is None:
                    continue
                entry = values.setdefault(gpu, {"gpu": gpu, "uuid": sample.labels.get("UUID", "")})
                entry[field] = int(sample.value) if field == "xid" else float(sample.value)
    except ValueError:
        return []  # not the exposition format: no reading
    return [GpuReading(**entry) for entry in values.values()]  # type: ignore[arg-type]
