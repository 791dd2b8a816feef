"""Reading Slurm's own output and timing the forced save (``ckptd.notices.slurm_job``), and
whether ``ckptd exec`` requeues (``ckptd.supervision.requeue``): pure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ckptd.notices.slurm_job import (
    MEASURED_LEAD_FACTOR,
    UNMEASURED_LEAD_SECONDS,
    SlurmParseError,
    job_id_of,
    lead_seconds,
    parse_config_seconds,
    parse_duration,
    parse_grace_seconds,
    parse_job,
    parse_slurm_time,
    save_due_at,
)
from ckptd.supervision.requeue import classify, decide_requeue

# `scontrol -o show job 1` of Slurm 22.05.8 on the test host, a running job of --time=1.
RUNNING = (
    "JobId=1 JobName=job.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 "
    "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:01 "
    "TimeLimit=00:01:00 TimeMin=N/A SubmitTime=2026-12-04T21:21:32 "
    "EligibleTime=2026-12-04T21:21:32 AccrueTime=2026-12-04T21:21:32 "
    "StartTime=2026-12-04T21:21:33 EndTime=2026-12-04T21:22:33 Deadline=N/A "
    "PreemptEligibleTime=2026-12-04T21:21:33 PreemptTime=None SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-12-04T21:21:33 Scheduler=Backfill Partition=low "
    "AllocNode:Sid=localhost:21924 ReqNodeList=(null) ExcNodeList=(null) NodeList=vm "
    "BatchHost=vm NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=1,node=1,billing=1 Command=/tmp/job.sh WorkDir=/tmp StdOut=/tmp/job.out Power=\n"
)
# The same job during a preemption's grace period: PreemptTime set, EndTime moved to
# PreemptTime + GraceTime (30 s), and its second attempt (Restarts=1).
PREEMPTED = (
    RUNNING.replace("PreemptTime=None", "PreemptTime=2026-12-04T21:21:50")
    .replace("EndTime=2026-12-04T21:22:33", "EndTime=2026-12-04T21:22:20")
    .replace("Restarts=0", "Restarts=1")
)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_a_running_job_is_read_with_its_end_in_the_hosts_zone() -> None:
    job = parse_job(RUNNING, tz=UTC)
    assert job.job_id == "1"
    assert job.state == "RUNNING"
    assert job.end_time == at("2026-12-04T21:22:33")
    assert job.time_limit == 60
    assert job.preempt_time is None and not job.preempted
    assert job.partition == "low"
    assert job.requeue and job.batch and job.restarts == 0


def test_a_preempted_job_has_its_preempt_time_and_its_end_moved() -> None:
    job = parse_job(PREEMPTED, tz=UTC)
    assert job.preempted
    assert job.preempt_time == at("2026-12-04T21:21:50")
    assert job.end_time == at("2026-12-04T21:22:20")
    assert job.restarts == 1


def test_no_job_line_is_a_parse_error_naming_the_output() -> None:
    with pytest.raises(SlurmParseError, match="Invalid job id"):
        parse_job("slurm_load_jobs error: Invalid job id specified\n")


def test_slurm_times_without_a_zone_are_local_and_none_means_none() -> None:
    assert parse_slurm_time("None") is None
    assert parse_slurm_time("Unknown") is None
    assert parse_slurm_time("N/A") is None
    local = parse_slurm_time("2026-12-04T21:22:33")
    assert local is not None and local.tzinfo is not None
    assert local == datetime(2026, 12, 4, 21, 22, 33).astimezone()
    with pytest.raises(SlurmParseError):
        parse_slurm_time("tomorrow")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("00:01:00", 60),
        ("2", 120),
        ("1:30", 90),
        ("1-00:00:00", 86400),
        ("2-3", 2 * 86400 + 3 * 3600),
        ("1-02:30", 86400 + 2 * 3600 + 30 * 60),
        ("UNLIMITED", None),
        ("INFINITE", None),
    ],
)
def test_durations_in_every_form_slurm_prints(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


def test_grace_time_and_kill_wait_are_read_in_seconds() -> None:
    partition = "PartitionName=low AllowGroups=ALL Default=YES GraceTime=30 Hidden=NO"
    assert parse_grace_seconds(partition) == 30
    assert parse_grace_seconds("PartitionName=x Hidden=NO") is None
    config = "Configuration data as of x\nJobRequeue              = 1\nKillWait                = 30 sec\n"
    assert parse_config_seconds(config, "KillWait") == 30
    assert parse_config_seconds(config, "OverTimeLimit") is None


def test_the_lead_is_the_measured_save_and_upload_doubled_plus_the_margin() -> None:
    assert lead_seconds(0, 30, 4.0, 6.0) == MEASURED_LEAD_FACTOR * 10 + 30
    assert lead_seconds(0, 30, 0.0, 0.0) == UNMEASURED_LEAD_SECONDS + 30
    assert lead_seconds(100, 30, 4.0, 6.0) == 130  # configured: the measurement is ignored


def test_the_forced_save_is_due_lead_seconds_before_the_end() -> None:
    job = parse_job(RUNNING, tz=UTC)
    assert save_due_at(job, 32) == at("2026-12-04T21:22:01")
    unlimited = parse_job(RUNNING.replace("TimeLimit=00:01:00", "TimeLimit=UNLIMITED"), tz=UTC)
    assert save_due_at(unlimited, 32) is None


def test_the_job_id_comes_from_slurm_job_id_or_the_older_name() -> None:
    assert job_id_of({"SLURM_JOB_ID": "42"}) == "42"
    assert job_id_of({"SLURM_JOBID": "7"}) == "7"
    assert job_id_of({"SLURM_JOB_ID": " "}) is None
    assert job_id_of({}) is None
    # One task of array 40 has SLURM_JOB_ID 40 too: scontrol would act on them all.
    array = {"SLURM_JOB_ID": "40", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "0"}
    assert job_id_of(array) == "40_0"


def test_a_sigterm_is_classified_by_what_slurm_says_of_the_job() -> None:
    assert classify("slurm", "time-limit", preempted=False, past_end=False) == "time-limit"
    assert classify("sigterm", "sigterm", preempted=True, past_end=False) == "preemption"
    assert classify("sigterm", "sigterm", preempted=False, past_end=True) == "time-limit"
    assert classify("sigterm", "sigterm", preempted=False, past_end=False) == "other"
    assert classify(None, None, preempted=True, past_end=True) == "none"


def requeue(mode: str = "auto", kind: str = "time-limit", **kw: bool) -> bool:
    facts = {"requeueable": True, "committed": True, "progressed": True} | kw
    return decide_requeue(mode, kind, **facts).requeue  # type: ignore[arg-type]


def test_auto_requeues_a_requeueable_job_after_slurms_interruptions() -> None:
    assert requeue("auto", "time-limit")
    assert requeue("auto", "preemption")
    assert requeue("auto", "user-signal")
    assert not requeue("auto", "other")  # scancel, a node going down


def test_a_finished_job_and_a_give_up_are_never_requeued() -> None:
    for mode in ("auto", "always", "never"):
        assert not requeue(mode, "none")


def test_no_requeue_without_a_committed_and_newer_emergency_checkpoint() -> None:
    for mode in ("auto", "always"):
        assert not requeue(mode, "time-limit", committed=False)
        # A lead longer than the job: the attempt saves where it started; for ever else.
        assert not requeue(mode, "time-limit", progressed=False)


def test_always_and_never() -> None:
    assert requeue("always", "other")
    assert not requeue("never", "preemption")


def test_a_job_submitted_with_no_requeue_is_never_requeued() -> None:
    # Slurm refuses it: "Requested operation is presently disabled".
    for mode in ("auto", "always"):
        assert not requeue(mode, "time-limit", requeueable=False)


def test_a_preemption_deadline_is_the_moved_end_time() -> None:
    job = parse_job(PREEMPTED, tz=UTC)
    assert job.end_time is not None and job.preempt_time is not None
    assert job.end_time - job.preempt_time == timedelta(seconds=30)
