"""A fake DCGM exporter on loopback: ``GET /metrics`` in the Prometheus text format, the
field names, types, help texts and labels dcgm-exporter uses.

Shape, as documented: dcgm-exporter's README (``curl localhost:9400/metrics``: ``#
HELP``/``# TYPE`` lines, then ``DCGM_FI_DEV_SM_CLOCK{gpu="0",
UUID="GPU-604ac76c-..."} 139``) and its ``etc/default-counters.csv`` (one DCGM field per
line: the Prometheus type and help text, quoted below). Labels beyond ``gpu`` and
``UUID`` (``device``, ``modelName``, ``Hostname``) as the exporter adds them.

``set_gpu`` changes one GPU's fields; ``set_mode`` (``ok``, ``500``, ``garbage``, ``hang``)
as every fake.
"""

from __future__ import annotations

from aiohttp import web

from tests.support.fakes import FakeServer

# (field, type, help), from etc/default-counters.csv.
FIELDS = [
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors."),
    (
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "counter",
        "Throttling duration due to thermal constraints (in us).",
    ),
    (
        "DCGM_FI_DEV_POWER_VIOLATION",
        "counter",
        "Throttling duration due to power constraints (in us).",
    ),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
]
QUIET = {
    "DCGM_FI_DEV_GPU_TEMP": 41,
    "DCGM_FI_DEV_XID_ERRORS": 0,
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0,
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 0,
    "DCGM_FI_DEV_THERMAL_VIOLATION": 0,
    "DCGM_FI_DEV_POWER_VIOLATION": 0,
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 0,
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
}


class FakeDcgmExporter(FakeServer):
    """``/metrics`` for ``gpus`` H100s, each quiet until ``set_gpu`` says otherwise."""

    def __init__(self, gpus: int = 2) -> None:
        super().__init__()
        self.gpus = {str(i): dict(QUIET) for i in range(gpus)}

    def set_gpu(self, gpu: int, **fields: float) -> None:
        """Set fields of GPU ``gpu`` by their DCGM names."""
        with self._lock:
            self.gpus[str(gpu)].update(fields)
            self._changed()

    def text(self) -> str:
        lines = []
        with self._lock:
            for name, kind, help_text in FIELDS:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                for gpu, fields in self.gpus.items():
                    labels = (
                        f'gpu="{gpu}",UUID="GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e5{gpu}",'
                        f'device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",'
                        'Hostname="node-0"'
                    )
                    lines.append(f"{name}{{{labels}}} {fields[name]}")
        return "\n".join(lines) + "\n"

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._get)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        mode = self.mode
        if mode == "hang":
            await self.hang()
            mode = self.mode
        if mode in ("500", "503"):
            return web.Response(status=int(mode), text="error")
        if mode == "garbage":
            return web.Response(text="<html>\ufffd not metrics", content_type="text/html")
        return web.Response(text=self.text(), content_type="text/plain")
