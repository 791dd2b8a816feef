"""The ``[health]`` section: the node's health sources (``ckptd.health``), the kernel log,
a DCGM exporter or NVML, memory pressure, the checkpoint filesystem and the store's
reachability, and what a health event of each severity makes the daemon do.

Each key carries its description: docs/configuration.md is generated from this model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from ckptd.config.base import Section, absolute_path, check_http_url

__all__ = ["HealthAction", "HealthConfig"]

#: What a health event makes the daemon do (docs/health.md, "What each action does").
HealthAction = Literal["save", "save-and-stop", "report"]


class HealthConfig(Section):
    """Health sources (docs/health.md): faults that come with no notice (a GPU's Xid, the
    OOM killer, an I/O error, memory pressure, a filling disk, a lost store) make the
    trainer save before they take the node; off unless `enabled`."""

    enabled: bool = Field(
        default=False,
        description="Read the health sources below every `poll_interval_seconds` and act "
        "on their events by severity (`on_degrading`, `on_fatal`, `on_warning`).",
    )
    poll_interval_seconds: float = Field(
        default=2.0,
        gt=0,
        le=60,
        allow_inf_nan=False,
        description="How often each source is read.",
    )
    kmsg: str = Field(
        default="/dev/kmsg",
        description="The kernel log to follow for NVIDIA Xid, OOM-kill and I/O-error lines "
        '(absolute; `/dev/kmsg`, or a file or FIFO fed with its lines); `""` = off. Only '
        "lines written after the daemon starts are read.",
    )
    psi: str = Field(
        default="/proc/pressure/memory",
        description='The node\'s memory pressure (PSI) file (absolute); `""` = off.',
    )
    cgroup: str = Field(
        default="",
        description="The trainer's cgroup v2 directory (absolute, e.g. "
        "`/sys/fs/cgroup/system.slice/train.service`): its `memory.pressure`, "
        '`memory.events` (OOM kills) and `memory.current` against `memory.max`; `""` = off.',
    )
    dcgm_url: str = Field(
        default="",
        description="A DCGM exporter's metrics on this node (e.g. "
        "`http://127.0.0.1:9400/metrics`): each GPU's last Xid, double-bit ECC errors, "
        'rows remapped, throttling and temperature; `""` = off.',
    )
    nvml: bool = Field(
        default=False,
        description="Read each GPU through NVML (`nvidia-ml-py`, installed beside ckptd): "
        "double-bit ECC errors, rows remapped (and pending), throttling for heat and "
        "power, temperature; for nodes that run no DCGM exporter.",
    )
    gpu_temperature_celsius: float = Field(
        default=90.0,
        ge=30,
        le=130,
        allow_inf_nan=False,
        description="A GPU hotter than this (`dcgm_url`, `nvml`) is a warning event.",
    )
    gpu_corrected_ecc_per_minute: float = Field(
        default=60.0,
        ge=0,
        le=1_000_000,
        allow_inf_nan=False,
        description="A GPU's single-bit (corrected) ECC errors growing faster than this "
        "many a minute between two polls (`dcgm_url`, `nvml`) is a degrading event: "
        "climbing corrected errors come before uncorrectable ones. 0 = no bound.",
    )
    memory_full_avg10_percent: float = Field(
        default=20.0,
        gt=0,
        le=100,
        allow_inf_nan=False,
        description="Memory pressure above this share of the last 10 s with every task "
        "stalled (PSI `full avg10`) is a degrading event.",
    )
    memory_use_ratio: float = Field(
        default=0.95,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="The trainer's cgroup using more than this share of its `memory.max` is "
        "a degrading event (the OOM killer is next).",
    )
    disk_free_factor: float = Field(
        default=1.2,
        ge=1,
        le=1_000_000,
        allow_inf_nan=False,
        description="Less free space on a watch dir's filesystem than this many times the "
        "run's last save is a warning event: the next save would not fit.",
    )
    unreachable_seconds: float = Field(
        default=30.0,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="The store unreachable for longer than this is a degrading event: the "
        "trainer saves locally, and the checkpoint ships once the store is back. So is "
        "every peer of the run unreachable this long, with `[peers]` on (a node cut off "
        "from its cluster network).",
    )
    save_interval_seconds: float = Field(
        default=600.0,
        ge=0,
        le=86400,
        allow_inf_nan=False,
        description="At most one save per event kind in this long: a flood of one event "
        "gives one save, the rest are reported.",
    )
    save_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="A `save` waits this long at most for its checkpoint to commit before "
        "the daemon leaves the save's emergency mode.",
    )
    on_degrading: HealthAction = Field(
        default="save",
        description="What a degrading event (the node still trains, but is failing) does: "
        '`"save"` (the trainer saves and trains on), `"save-and-stop"` (as a preemption '
        'notice) or `"report"` only.',
    )
    on_fatal: HealthAction = Field(
        default="report",
        description="What a fatal event (too late: the GPU or the trainer is gone) does; "
        "by default it is recorded and no signal is sent.",
    )
    on_warning: HealthAction = Field(
        default="report",
        description="What a warning event (a filesystem too full for the next save, say) does.",
    )
    loss_window: int = Field(
        default=50,
        ge=2,
        le=100_000,
        description="The loss-spike rule's trailing window: the last this many losses the "
        "trainer reported (`report_step(step, loss=...)`) judged normal; also how many "
        "normal reports in a row end a spike (docs/health.md). Read whether or not "
        "`enabled` is set.",
    )
    loss_z: float = Field(
        default=6.0,
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="A loss more than this many standard deviations above the window's mean "
        "is a spike.",
    )
    loss_min_reports: int = Field(
        default=20,
        ge=2,
        le=100_000,
        description="No loss is judged a spike before the window holds this many (a "
        "non-finite loss always is); at most `loss_window`.",
    )
    protect_hours: float = Field(
        default=24.0,
        ge=0,
        le=24 * 365,
        allow_inf_nan=False,
        description="On a loss spike or a non-finite loss, the newest committed checkpoint "
        "from before it is kept from retention (every node's and `ckptd prune`'s) this "
        "long, or until the loss is back for `loss_window` reports; 0 = spikes are "
        "counted, nothing is kept.",
    )
    condition_file: Path | None = Field(
        default=None,
        description="Where the node's health condition is written as JSON for "
        "node-problem-detector or NVSentinel (absolute); unset = "
        "`<state.dir>/health-condition.json`.",
    )

    @field_validator("kmsg", "psi", "cgroup")
    @classmethod
    def _absolute_or_off(cls, value: str) -> str:
        if value and not Path(value).is_absolute():
            raise ValueError('must be an absolute path, or "" for off')
        return value

    @field_validator("dcgm_url")
    @classmethod
    def _dcgm_is_http(cls, value: str) -> str:
        if value:
            check_http_url(value, allow_path=True)
        return value

    @field_validator("loss_min_reports")
    @classmethod
    def _min_within_window(cls, value: int, info: ValidationInfo) -> int:
        window = info.data.get("loss_window")
        if isinstance(window, int) and value > window:
            raise ValueError(f"must be at most loss_window ({window})")
        return value

    @field_validator("condition_file")
    @classmethod
    def _condition_is_absolute(cls, value: Path | None) -> Path | None:
        return None if value is None else absolute_path(value)

    def condition_path(self, state_dir: Path) -> Path:
        """Where the condition file goes: ``condition_file``, else under ``state_dir``."""
        if self.condition_file is not None:
            return self.condition_file
        return state_dir / "health-condition.json"
