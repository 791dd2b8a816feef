"""``ckptd exec`` as a real Slurm batch job (the session's one-host Slurm, ``slurm``
fixture): the job's time limit, a preemption by a higher-priority job, ``--signal`` and
``scancel --signal`` each make the trainer save, the emergency checkpoint is committed
before the end, the job is requeued, the next attempt resumes there, and the run ends
bit-identical to an uninterrupted one. A job that finishes is not requeued; a trainer
that fails at start-up is given up on (76), not requeued.

The trainer is ``tests.support.trainers.plain_dcp`` (real PyTorch, DCP checkpoints), the
store the session's SeaweedFS. The scripts hold no trap and no ``scontrol`` of their own.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DAEMON_AT_TEST_PRIORITY
from tests.support.daemon import wait_until
from tests.support.exec_harness import ExecNode, trainer_command
from tests.support.harness import (
    Env,
    TrainerSpec,
    compare_weights,
    finish_reference,
    start_reference,
)
from tests.support.slurm import GRACE_SECONDS, Slurm
from tests.support.trainers.procs import script_env

pytestmark = pytest.mark.slurm

# Slurm requeues a job ~14 s after `scontrol requeue` here (cred_expire=10,
# sched_interval=5); each wait below allows for a loaded machine on top.
REQUEUE_TIMEOUT = 120.0
# The smallest time limit worth a forced save (sbatch --time takes minutes).
TIME_LIMIT_MINUTES = 2


def spec(max_steps: int) -> TrainerSpec:
    # ~10 steps a second: a step is ~2 ms of compute plus the delay.
    return TrainerSpec(
        name="pytorch-dcp",
        module="tests.support.trainers.plain_dcp",
        max_steps=max_steps,
        save_every=50,
        step_delay=0.1,
        interruptions=1,
        checkpoint_name="step-{}",
    )


class SlurmExecJob:
    """``ckptd exec -- plain_dcp`` submitted as one batch job; every attempt appends its
    log to ``exec.log`` (``--open-mode=append``)."""

    def __init__(
        self,
        slurm: Slurm,
        work: Path,
        spec: TrainerSpec,
        env: Env,
        *sbatch: str,
        trainer_args: tuple[str, ...] = (),
    ) -> None:
        self.slurm = slurm
        self.spec = spec
        # The [slurm] section re-reads the job every second (5 s by default) so that the
        # preemption test sees PreemptTime soon; everything else is the default.
        self.node = ExecNode(
            work / "job",
            spec,
            env,
            shutdown_timeout=60.0,
            extra_config="[slurm]\npoll_interval_seconds = 1\n",
        )
        command = [
            sys.executable,
            "-m",
            "ckptd",
            "exec",
            "--config",
            str(self.node.config),
            "--shutdown-timeout",
            "60",
            "--",
            *trainer_command(spec, self.node.dir),
            *trainer_args,
        ]
        self.script = self.node.dir / "job.sh"
        # `exec`: ckptd is the batch shell, so a B: signal reaches it.
        self.script.write_text(f"#!/bin/bash\nexec {shlex.join(command)}\n")
        self.sbatch = [
            f"--time={TIME_LIMIT_MINUTES}",
            "--requeue",
            "--open-mode=append",
            f"--output={self.node.log_path}",
            f"--chdir={self.node.dir}",
            "--job-name=ckptd-test",
            *sbatch,
        ]
        self.job_id = ""

    def submit(self) -> SlurmExecJob:
        env = script_env(self.node.dir, **DAEMON_AT_TEST_PRIORITY)
        self.job_id = self.slurm.submit(self.script, *self.sbatch, env=env)
        return self

    def field(self, name: str) -> str:
        return self.slurm.job_field(self.job_id, name)

    def details(self) -> str:
        return (
            f"{self.slurm.command('scontrol', 'show', 'job', self.job_id, check=False).stdout}\n"
            f"{self.node.log_tail()}"
        )

    def wait_for(self, what: str, timeout: float, check: Any) -> Any:
        return wait_until(check, timeout, what, interval=0.2, details=self.details)

    def wait_attempt_progress(self, attempt: int, steps: int, timeout: float) -> dict[str, Any]:
        """Attempt ``attempt`` (0 first) running and ``steps`` past where it resumed."""

        def check() -> dict[str, Any] | None:
            if self.field("Restarts") != str(attempt) or self.field("JobState") != "RUNNING":
                return None
            doc = self.node.progress_doc()
            if doc is None or doc["first_step_at"] < self.attempt_started(attempt):
                return None
            return doc if doc["step"] >= doc["resumed_from"] + steps else None

        return dict(self.wait_for(f"attempt {attempt} to progress", timeout, check))

    def attempt_started(self, attempt: int) -> float:
        times = self.node.event_times("slurm_job")
        return times[attempt] if len(times) > attempt else float("inf")

    def wait_state(self, state: str, timeout: float) -> None:
        self.wait_for(f"job {state}", timeout, lambda: self.field("JobState") == state)

    def events(self, name: str) -> list[dict[str, Any]]:
        return self.node.events(name)


def event_time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def step_of(name: str) -> int:
    """The step of a ``step-<N>`` checkpoint name."""
    return int(name.rsplit("-", 1)[1])


def assert_lossless_chain(job: SlurmExecJob) -> tuple[list[str], list[dict[str, Any]]]:
    """Each interrupted attempt committed its emergency checkpoint before the deadline and
    was requeued; the next one resumed from that checkpoint, or from a later one the same
    attempt committed before it ended (a second signal, as `scancel --signal=USR1 --batch`
    beside ckptd's own can give, makes the trainer save again a step or two on): no step
    lost. The last finished and was not requeued. The notices' kinds, and the committed
    events."""
    kinds = [n["kind"] for n in job.events("notice_received")]
    interruptions = len(kinds)
    committed = job.events("emergency_checkpoint_committed")
    requeued = job.events("slurm_requeued")
    decisions = job.events("slurm_requeue_decision")
    started = job.events("trainer_started")
    assert len(committed) == interruptions, job.node.log_tail()
    assert len(requeued) == interruptions, job.node.log_tail()
    assert [d["requeue"] for d in decisions] == [True] * interruptions + [False]
    assert decisions[-1]["interruption"] == "none"
    assert len(started) == interruptions + 1, job.node.log_tail()
    saved = job.events("checkpoint_committed")
    for commit, next_start in zip(committed, started[1:], strict=True):
        assert commit["committed_before_deadline"] is True, commit
        resumed = Path(next_start["resume_from"]).name
        before = {c["checkpoint"] for c in saved if event_time(c) < event_time(next_start)}
        assert resumed in before, (next_start, sorted(before))
        assert step_of(resumed) >= step_of(commit["checkpoint"]), (next_start, commit)
    assert job.field("JobState") == "COMPLETED"
    assert job.field("Restarts") == str(interruptions)
    return kinds, committed


def assert_bit_identical(job: SlurmExecJob, reference: Any) -> None:
    ref_final, _ = finish_reference(job.spec, reference)
    result = job.node.result_doc()
    assert result["step"] == job.spec.max_steps, result
    mismatched = compare_weights(ref_final, job.node.final)
    assert not mismatched, f"final weights differ from the reference: {mismatched[:5]}"


@pytest.mark.timeout(900)
def test_time_limit_then_scancel_signal_each_commit_requeue_and_resume_bit_identical(
    slurm: Slurm, local_s3: Any, s3_dest: str, tmp_path: Path
) -> None:
    """No --signal in the script: the time limit (2 min; the trainer needs ~2.2) is read
    from Slurm and the save forced before it; then `scancel --signal=USR1 --batch`; then
    the trainer finishes and the job ends COMPLETED, not requeued. (On a machine slow
    enough that the last attempt meets its time limit too, that is one more requeue.)"""
    work = spec(max_steps=1000)
    reference = start_reference(work, tmp_path)
    job = SlurmExecJob(slurm, tmp_path, work, Env(s3_dest, local_s3.endpoint_url)).submit()
    try:
        job.wait_state("RUNNING", timeout=60)
        end = job.field("EndTime")
        job.wait_attempt_progress(1, steps=30, timeout=TIME_LIMIT_MINUTES * 60 + REQUEUE_TIMEOUT)
        [notice] = job.events("notice_received")
        assert (notice["source"], notice["kind"]) == ("slurm", "time-limit")
        assert datetime.fromisoformat(notice["deadline"].replace("Z", "+00:00")) == (
            datetime.fromisoformat(end).astimezone()
        )
        job.slurm.command("scancel", "--signal=USR1", "--batch", job.job_id)
        job.wait_state("COMPLETED", timeout=4 * REQUEUE_TIMEOUT + 2 * TIME_LIMIT_MINUTES * 60)
        kinds, committed = assert_lossless_chain(job)
        assert kinds[:2] == ["time-limit", "user-signal"], kinds
        assert set(kinds[2:]) <= {"time-limit"}, kinds
        report(job, kinds, committed)
        assert_bit_identical(job, reference)
    finally:
        job.slurm.command("scancel", job.job_id, check=False)
        reference.kill9()


@pytest.mark.timeout(900)
def test_preemption_within_grace_then_signal_b_usr1_each_requeue_and_resume_bit_identical(
    slurm: Slurm, local_s3: Any, s3_dest: str, tmp_path: Path
) -> None:
    """A job in the low partition (GraceTime 30) preempted by one in the high partition:
    the moved EndTime is the notice, committed within the grace, requeued; the next attempt
    gets `--signal=B:USR1@60` (30-60 s after it starts; the trainer waits for it at step
    200), requeued again; the third needs ~15 s and finishes bit-identical."""
    work = spec(max_steps=300)
    reference = start_reference(work, tmp_path)
    job = SlurmExecJob(
        slurm,
        tmp_path,
        work,
        Env(s3_dest, local_s3.endpoint_url),
        "--partition=low",
        "--signal=B:USR1@60",
        trainer_args=("--pause-at", "200"),
    ).submit()
    try:
        job.wait_attempt_progress(0, steps=60, timeout=120)
        blocker = tmp_path / "high.sh"
        blocker.write_text("#!/bin/bash\ntrue\n")
        preemptor = slurm.submit(
            blocker,
            "--partition=high",
            f"--output={tmp_path / 'high.out'}",
            "--time=1",
            env=script_env(tmp_path),
        )
        job.wait_for("the preemption's notice", 60, lambda: job.events("notice_received"))
        job.wait_state("COMPLETED", timeout=4 * REQUEUE_TIMEOUT + 2 * TIME_LIMIT_MINUTES * 60)
        kinds, committed = assert_lossless_chain(job)
        assert kinds[:2] == ["preemption", "user-signal"], kinds
        assert set(kinds[2:]) <= {"user-signal", "time-limit"}, kinds
        preempted = committed[0]
        assert 0 < preempted["seconds_left_at_commit"] <= GRACE_SECONDS
        assert slurm.job_field(preemptor, "JobState") == "COMPLETED"
        report(job, kinds, committed)
        assert_bit_identical(job, reference)
    finally:
        job.slurm.command("scancel", job.job_id, check=False)
        reference.kill9()


def test_a_trainer_failing_at_start_up_is_given_up_on_not_requeued(
    slurm: Slurm, local_s3: Any, s3_dest: str, tmp_path: Path
) -> None:
    job = SlurmExecJob(slurm, tmp_path, spec(max_steps=10), Env(s3_dest, local_s3.endpoint_url))
    fail = [sys.executable, "-c", "import sys; sys.exit(3)"]
    command = shlex.split(job.script.read_text().splitlines()[1])[1:]
    cut = command.index("--")
    job.script.write_text(f"#!/bin/bash\nexec {shlex.join(command[: cut + 1] + fail)}\n")
    job.submit()
    try:
        job.wait_for(
            "the job to end", 120, lambda: job.field("JobState") in ("FAILED", "COMPLETED")
        )
        assert job.field("JobState") == "FAILED"
        assert job.field("ExitCode") == "76:0"
        assert job.field("Restarts") == "0"
        [decision] = job.events("slurm_requeue_decision")
        assert decision["requeue"] is False and decision["interruption"] == "none"
    finally:
        job.slurm.command("scancel", job.job_id, check=False)


def report(job: SlurmExecJob, kinds: list[str], committed: list[dict[str, Any]]) -> None:
    """The figures docs/slurm.md quotes, in the test's output."""
    for kind, event in zip(kinds, committed, strict=True):
        print(
            json.dumps(
                {
                    "job": job.job_id,
                    "kind": kind,
                    "checkpoint": event["checkpoint"],
                    "committed_after_s": event["committed_after_s"],
                    "seconds_left_at_commit": event["seconds_left_at_commit"],
                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(event_time(event))),
                }
            )
        )
