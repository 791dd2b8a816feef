"""The ``[slurm]`` section: what ckptd does inside a Slurm job (``ckptd.notices.slurm``,
``ckptd.supervision.slurm_exec``).

Each key carries its description: docs/configuration.md is generated from this model.
"""

from __future__ import annotations

from signal import Signals
from typing import Literal

from pydantic import Field, field_validator

from ckptd.config.base import Section

__all__ = ["RequeueMode", "SlurmConfig"]

# After an interruption ckptd exec has committed the emergency checkpoint of:
RequeueMode = Literal["auto", "always", "never"]


class SlurmConfig(Section):
    """Inside a Slurm job: its time limit, its preemption and a user's signal as notices."""

    enabled: Literal["auto", "off"] = Field(
        default="auto",
        description="`auto`: inside a Slurm job (`SLURM_JOB_ID` set) the job's time limit, "
        "preemption and `signal` are notices; `off`: Slurm is not asked.",
    )
    lead_seconds: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="How long before the job's end a save is forced, before the margin; "
        "0 = twice this run's measured save + upload time (60 s until a save is measured).",
    )
    lead_margin_seconds: float = Field(
        default=30.0,
        ge=0,
        allow_inf_nan=False,
        description="Added to the lead: the forced save starts this much earlier still.",
    )
    poll_interval_seconds: float = Field(
        default=5.0,
        gt=0,
        le=300,
        allow_inf_nan=False,
        description="How often the job's end time is read again (`scontrol show job`): it "
        "moves with `scontrol update TimeLimit` and with a preemption's grace period.",
    )
    grace_seconds: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="The deadline of a SIGTERM from Slurm (a preempted `srun` step); 0 = "
        "the job's partition's `GraceTime`, else `KillWait`, read from Slurm.",
    )
    signal: str = Field(
        default="SIGUSR1",
        description="The signal of `sbatch --signal=B:SIG@N` or `scancel --signal=SIG "
        "--batch` that is a notice (deadline: the job's end).",
    )
    requeue: RequeueMode = Field(
        default="auto",
        description="`ckptd exec`, after the emergency checkpoint is committed: `auto` "
        "requeues a requeueable job (`--requeue`) interrupted by its time limit, a "
        "preemption or `signal`; `always` one interrupted by anything (`scancel`'s SIGTERM "
        "too); `never`.",
    )

    @field_validator("signal")
    @classmethod
    def _signal_is_catchable(cls, value: str) -> str:
        name = value.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in Signals.__members__:
            raise ValueError("must be a signal name such as SIGUSR1 or SIGUSR2")
        if name in ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT"):
            raise ValueError(
                "must be a signal ckptd can catch and does not already use (not SIGKILL, "
                "SIGSTOP, SIGTERM or SIGINT): SIGUSR1 or SIGUSR2"
            )
        return name
