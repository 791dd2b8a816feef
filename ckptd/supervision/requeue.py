"""Whether ``ckptd exec`` requeues its Slurm job when it ends (pure).

Slurm does not requeue a job at its time limit, even with ``--requeue``; a preempted job
that exits by itself (as ``ckptd exec`` does once its emergency checkpoint is committed)
is COMPLETED, not requeued; ``scontrol requeue $SLURM_JOB_ID`` from inside the job puts it
back in the queue at once, to start again from the top of its script with
``SLURM_RESTART_COUNT`` one higher. So ``ckptd exec`` requeues, after the emergency
checkpoint is committed, by ``[slurm] requeue``:

    never    never
    auto     a job interrupted by its time limit, a preemption, or the user's signal
    always   a job interrupted by anything (a plain SIGTERM too)

and in every mode never when
- the job is not requeueable (``Requeue=0``: ``--no-requeue``, or ``JobRequeue=0`` and no
  ``--requeue``): Slurm refuses ("Requested operation is presently disabled");
- no interruption came: the trainer finished its work, or was given up on (exit 76: a
  trainer that fails at start-up is not requeued for ever);
- the emergency checkpoint was not committed (exit 75: the store may be what failed);
- the emergency checkpoint is no newer than the one the attempt started from: an attempt
  that cannot get past its restore within the job's time (a lead longer than the job)
  would otherwise be requeued for ever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: What interrupted the attempt, from Slurm's point of view.
Interruption = Literal["time-limit", "preemption", "user-signal", "other", "none"]
SLURM_INTERRUPTIONS: frozenset[str] = frozenset({"time-limit", "preemption", "user-signal"})


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    reason: str


def classify(
    notice_source: str | None,
    notice_kind: str | None,
    *,
    preempted: bool,
    past_end: bool,
) -> Interruption:
    """The interruption behind a notice: a Slurm notice says it itself; a SIGTERM is a
    preemption when Slurm set ``PreemptTime``, the time limit when the job is past its
    ``EndTime``, else something else (``scancel``, a node going down)."""
    if notice_source is None or notice_kind is None:
        return "none"
    if notice_source == "slurm" and notice_kind in SLURM_INTERRUPTIONS:
        return notice_kind  # type: ignore[return-value]  # checked against the set above
    if preempted:
        return "preemption"
    if past_end:
        return "time-limit"
    return "other"


def decide_requeue(
    mode: str,
    interruption: Interruption,
    *,
    requeueable: bool,
    committed: bool,
    progressed: bool,
) -> RequeueDecision:
    """The module doc's rule."""
    if mode == "never":
        return RequeueDecision(False, "slurm.requeue = never")
    if interruption == "none":
        return RequeueDecision(False, "not interrupted: the trainer ended by itself")
    if not committed:
        return RequeueDecision(False, "the emergency checkpoint was not committed")
    if not progressed:
        return RequeueDecision(
            False, "the emergency checkpoint is no newer than the one this attempt started from"
        )
    if not requeueable:
        return RequeueDecision(
            False, "the job is not requeueable (sbatch --requeue, or JobRequeue=1)"
        )
    if mode == "always":
        return RequeueDecision(True, f"slurm.requeue = always ({interruption})")
    if interruption not in SLURM_INTERRUPTIONS:
        return RequeueDecision(False, "interrupted by something other than Slurm's limits")
    return RequeueDecision(True, interruption)
