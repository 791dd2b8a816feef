"""The ``[drill]`` section: the preemption drill followed the whole way to a trainer that
loads the checkpoint (``ckptd.drill``), and its schedule.

Each key carries its description: docs/configuration.md is generated from this model.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from ckptd.config.base import Section, absolute_path, parse_duration

__all__ = ["DrillConfig"]


class DrillConfig(Section):
    """The drill (`ckptd drill`, docs/preemption.md "The drill"): a simulated notice, the
    emergency checkpoint committed, restored into a scratch dir, every byte verified, and
    loaded by `check`; and, with `every`, its schedule."""

    every: str = Field(
        default="0",
        description='How often the daemon drills by itself: `"7d"`, `"12h"`, `"30m"` or '
        'seconds; `"0"` = only by hand (`ckptd drill`). One drill per run and period '
        "across the cluster, started at its due time unless a notice is active; a save in "
        "progress or the run's advised next save within `margin_seconds` holds it back at "
        "most `max_wait_seconds`. A period that ends without its drill is counted "
        "(`ckptd_drill_periods_missed`, alert `CkptdDrillScheduleMissed`).",
    )
    jitter: float = Field(
        default=0.25,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="The drill's time in each period is a point within its first `jitter` "
        "share, drawn from the run id and the period (the same on every node), so that "
        "runs sharing a schedule do not all drill at once.",
    )
    margin_seconds: float = Field(
        default=600.0,
        ge=0,
        allow_inf_nan=False,
        description="A scheduled drill waits while the run's advised next save (its last "
        "routine save plus the advised interval) is less than this far before or after now, "
        "but only until a routine save commits after its due time: it then starts right "
        "after that save (so a run saving more often than this still drills), and never "
        "past `max_wait_seconds`.",
    )
    max_wait_seconds: float = Field(
        default=3600.0,
        ge=0,
        allow_inf_nan=False,
        description="The longest a save in progress or the margin holds a scheduled drill "
        "back past its due time (and never past halfway from its due time to the period's "
        "end); then it starts anyway, so every period has its drill.",
    )
    deadline_seconds: float = Field(
        default=120.0,
        ge=1,
        le=3600,
        allow_inf_nan=False,
        description="The simulated notice's deadline for a scheduled drill: the emergency "
        "checkpoint must be committed within it (`ckptd drill --deadline` for one by hand).",
    )
    check: list[str] = Field(
        default_factory=list,
        description="The load check: a command (argv list) run with the restored "
        "checkpoint's path as its last argument and in `CKPTD_RESUME_FROM`; exit 0 = "
        'loaded. E.g. `["python", "/opt/train/check_load.py"]`. Empty = the drill ends '
        "at verified and says the load was not checked.",
    )
    check_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="The load check is ended (its process group killed) after this long, "
        "and the drill fails at loaded.",
    )
    resume: list[str] = Field(
        default_factory=list,
        description="The restore-only drill's resume (`ckptd drill --restore-only "
        "--resume-steps N -- CMD` on the command line): the trainer's own command (argv "
        "list), started from the restored checkpoint (`CKPTD_RESUME_FROM`, with "
        "`CKPTD_WATCH_DIR` a scratch dir and `CKPTD_DRILL_RESUME_STEPS`) until it reports "
        "`resume_steps` steps (`ckptd.trainer.report_step`). Empty = no resume.",
    )
    resume_steps: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="How many steps the resumed trainer must report (`resume`); 0 = no "
        "resume stage.",
    )
    resume_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        allow_inf_nan=False,
        description="The resumed trainer must report its steps within this long; then its "
        "process group is killed and the drill fails at resumed.",
    )
    scratch_dir: Path | None = Field(
        default=None,
        description="Where the drill restores (absolute), one directory per drill, removed "
        "after it; unset = `<state.dir>/drill`.",
    )
    history: int = Field(
        default=10,
        ge=1,
        le=1000,
        description="The success rate in `ckptd status` and `ckptd report` is over this "
        "many of the run's last drills.",
    )

    @field_validator("every", mode="before")
    @classmethod
    def _every_is_a_duration(cls, value: object) -> object:
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # a bare number of seconds
        if isinstance(value, str):
            parse_duration(value)
        return value

    @field_validator("check", "resume", mode="before")
    @classmethod
    def _check_is_an_argv(cls, value: object) -> object:
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise ValueError(
                'must be a list of strings, the program and its arguments, e.g. ["python", '
                '"/opt/train/check_load.py"]'
            )
        if value and not value[0].strip():
            raise ValueError("must start with the program to run, e.g. python")
        return value

    @field_validator("scratch_dir")
    @classmethod
    def _scratch_is_absolute(cls, value: Path | None) -> Path | None:
        return None if value is None else absolute_path(value)

    @property
    def every_seconds(self) -> float:
        """``every`` in seconds (0 = never scheduled)."""
        return parse_duration(self.every)

    def scratch(self, state_dir: Path) -> Path:
        """Where drills restore: ``scratch_dir``, else ``<state_dir>/drill``."""
        return self.scratch_dir if self.scratch_dir is not None else state_dir / "drill"
