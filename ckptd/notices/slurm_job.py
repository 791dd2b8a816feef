"""What Slurm says about a job, and when a save must be forced before its end (pure).

Slurm (22.05, as Debian ships it) puts no end time in the job's environment; the job's
end is ``EndTime`` of ``scontrol show job`` (= ``StartTime + TimeLimit``, also ``squeue
-o %e``). It moves: ``scontrol update TimeLimit=`` changes it, and a preemption sets
``PreemptTime`` and moves ``EndTime`` to ``PreemptTime + GraceTime``. Times are printed in
the host's local time, without a zone (``2026-12-04T21:22:33``); ``None``, ``Unknown`` and
``N/A`` mean none. Slurm checks limits on a 30 s cycle, so the kill comes up to 30 s after
``EndTime``, never before: ``EndTime`` is a safe deadline.

A forced save must be *committed* by the end, so it starts ``lead`` seconds before it:
the run's measured save + upload time (the cadence history's medians), doubled, plus a
margin; a configured lead replaces the measured part; before any save is measured,
``UNMEASURED_LEAD_SECONDS`` plus the margin.

Pure: text and times in, values out; no clock, no process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo

#: Before a save of this run was measured, a forced save starts this long (plus the
#: margin) before the job's end.
UNMEASURED_LEAD_SECONDS = 60.0
#: Measured save + upload time is multiplied by this: the trainer first finishes its step.
MEASURED_LEAD_FACTOR = 2.0

_NO_TIME = frozenset({"", "none", "unknown", "n/a", "(null)"})


class SlurmParseError(ValueError):
    """Slurm's output is not what this module reads (a changed format, an error text)."""


def parse_fields(text: str) -> dict[str, str]:
    """``Key=Value`` tokens of ``scontrol -o show ...`` (one line; a value holds no space)."""
    fields: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key and key not in fields:
            fields[key] = value
    return fields


def parse_slurm_time(value: str, tz: tzinfo | None = None) -> datetime | None:
    """A Slurm time (``2026-12-04T21:22:33``, local time) as an aware datetime; None for
    ``None``/``Unknown``/``N/A``. ``tz`` is the host's zone (None: this process's)."""
    text = value.strip()
    if text.lower() in _NO_TIME:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise SlurmParseError(f"not a Slurm time: {value!r}") from None
    if parsed.tzinfo is not None:
        return parsed
    return parsed.replace(tzinfo=tz) if tz is not None else parsed.astimezone()


def parse_duration(value: str) -> float | None:
    """A Slurm duration (``[days-]hours:minutes:seconds``, ``minutes:seconds``, ``minutes``)
    in seconds; None for ``UNLIMITED``/``INFINITE``/``NONE``."""
    text = value.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE", "N/A", ""):
        return None
    days = 0
    if "-" in text:
        head, text = text.split("-", 1)
        days = int(head)
    try:
        parts = [float(p) for p in text.split(":")]
    except ValueError:
        raise SlurmParseError(f"not a Slurm duration: {value!r}") from None
    if len(parts) == 1 and days == 0:
        seconds = parts[0] * 60  # a bare number is minutes, as --time takes it
    elif len(parts) == 1:
        seconds = parts[0] * 3600
    elif len(parts) == 2:
        seconds = (parts[0] * 60 + parts[1]) if days == 0 else parts[0] * 3600 + parts[1] * 60
    elif len(parts) == 3:
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    else:
        raise SlurmParseError(f"not a Slurm duration: {value!r}")
    return days * 86400 + seconds


@dataclass(frozen=True)
class JobState:
    """The parts of ``scontrol -o show job ID`` a notice needs."""

    job_id: str
    state: str  # RUNNING, COMPLETING, PENDING, ...
    end_time: datetime | None
    preempt_time: datetime | None
    time_limit: float | None  # seconds; None = unlimited
    partition: str
    requeue: bool  # --requeue, or JobRequeue=1 and no --no-requeue
    restarts: int
    batch: bool

    @property
    def preempted(self) -> bool:
        return self.preempt_time is not None


def parse_job(text: str, tz: tzinfo | None = None) -> JobState:
    """``scontrol -o show job ID``'s line (the first job in it)."""
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("JobId=")), "")
    if not line:
        raise SlurmParseError(f"no JobId= in scontrol's output: {text.strip()[:200]!r}")
    f = parse_fields(line)
    try:
        restarts = int(f.get("Restarts", "0") or 0)
    except ValueError:
        restarts = 0
    return JobState(
        job_id=f["JobId"],
        state=f.get("JobState", ""),
        end_time=parse_slurm_time(f.get("EndTime", ""), tz),
        preempt_time=parse_slurm_time(f.get("PreemptTime", ""), tz),
        time_limit=parse_duration(f.get("TimeLimit", "UNLIMITED")),
        partition=f.get("Partition", ""),
        requeue=f.get("Requeue", "0") == "1",
        restarts=restarts,
        batch=f.get("BatchFlag", "0") == "1",
    )


def parse_grace_seconds(partition_text: str) -> float | None:
    """``GraceTime`` of ``scontrol -o show partition NAME`` in seconds (0 = none); None
    when absent. Slurm prints it in seconds."""
    value = parse_fields(partition_text).get("GraceTime")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return parse_duration(value)


def parse_config_seconds(config_text: str, key: str) -> float | None:
    """A ``Key = N sec`` line of ``scontrol show config`` (``KillWait = 30 sec``)."""
    for line in config_text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            words = value.split()
            try:
                return float(words[0]) if words else None
            except ValueError:
                return None
    return None


def lead_seconds(
    configured: float, margin: float, save_seconds: float, upload_seconds: float
) -> float:
    """How long before the job's end a forced save starts (module doc). ``configured``
    > 0 replaces the measured part; save and upload 0 mean "not measured yet"."""
    if configured > 0:
        return configured + margin
    measured = save_seconds + upload_seconds
    if measured <= 0:
        return UNMEASURED_LEAD_SECONDS + margin
    return MEASURED_LEAD_FACTOR * measured + margin


def save_due_at(job: JobState, lead: float) -> datetime | None:
    """When the time limit's forced save is due: ``lead`` before ``EndTime`` (None: the
    job has no end)."""
    if job.end_time is None or (job.time_limit is None and not job.preempted):
        return None
    return job.end_time - timedelta(seconds=lead)


def job_id_of(environ: Mapping[str, str]) -> str | None:
    """The job this process runs in: ``SLURM_JOB_ID`` (or the older ``SLURM_JOBID``); in
    a job array ``ARRAYID_TASKID``, since ``scontrol`` given the array's own id (which one
    task's ``SLURM_JOB_ID`` equals) acts on every task of the array."""
    value = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    if not value:
        return None
    array = environ.get("SLURM_ARRAY_JOB_ID", "").strip()
    task = environ.get("SLURM_ARRAY_TASK_ID", "").strip()
    return f"{array}_{task}" if array and task else value
