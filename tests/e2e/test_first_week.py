"""The operator's first week, walked as a new user walks it (issue 45), each step as the
docs show it and each result checked on what it did:

their own local S3 (``make s3``, its printed exports) -> ``ckptd doctor`` -> a real
PyTorch trainer under ``ckptd exec`` committing its checkpoints -> the metrics -> the
node's notice (SIGTERM), the emergency checkpoint committed -> ``ckptd restore --latest``
on a fresh node, byte for byte -> the trainer resumed there to its end -> ``prune``,
``rm``, ``check`` -> ``ckptd report``.

``make demo`` has its own test (``tests/process/test_demo.py``); the fresh clone is CI's."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

from tests.support.daemon import run_cli, wait_until
from tests.support.exec_harness import ExecNode, trainer_command
from tests.support.harness import RUN_ID, Env, TrainerSpec
from tests.support.own_s3 import own_s3

SPEC = TrainerSpec(
    name="pytorch-dcp",
    module="tests.support.trainers.plain_dcp",
    max_steps=60,
    save_every=20,
    step_delay=0.05,
    interruptions=1,
    checkpoint_name="step-{}",
)
NOTICE_AT = 40  # the trainer waits for the notice after this step
POLICY = "[retention]\nkeep_last = 2\n"
PREEMPTION = 'provider = "none"\nsigterm = "notice"'  # the pod's SIGTERM is its notice


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{run="{RUN_ID}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_new_users_first_week(tmp_path: Path) -> None:
    with own_s3(tmp_path / "s3") as s3:
        env = Env("s3://ckpt/first-week", s3.endpoint_url)
        first = ExecNode(
            tmp_path / "node-a",
            SPEC,
            env,
            extra_config=POLICY,
            preemption=PREEMPTION,
            command=[*trainer_command(SPEC, tmp_path / "node-a"), "--pause-at", str(NOTICE_AT)],
        )
        user = {**s3.exports}
        cli = ("--config", str(first.config))

        # The preflight: every check ok or a warning, none failed.
        doctor = run_cli("doctor", *cli, env=user)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert not [line for line in doctor.stdout.splitlines() if line.startswith("fail")]

        # Training under ckptd exec: two checkpoints committed, the metrics say so.
        try:
            first.start()
            wait_until(
                lambda: (
                    first.progress.exists()
                    and json.loads(first.progress.read_text() or "{}").get("step") == NOTICE_AT
                ),
                180,
                f"the trainer at step {NOTICE_AT}",
                details=first.log_tail,
            )
            wait_until(
                lambda: _metric(first.port, "ckptd_checkpoints_committed_total") >= 2,
                60,
                "two commits in the metrics",
                details=first.log_tail,
            )
            # The node's notice: the trainer saves, ckptd commits it, and all exit 0.
            first.signal(signal.SIGTERM)
            assert first.wait_exit(180) == 0, first.log_tail()
        finally:
            first.close()
        listed = run_cli("list", *cli, "--run", RUN_ID, env=user)
        assert listed.returncode == 0, listed.stderr
        newest = max(
            (p for p in first.ckpt.iterdir() if p.name.startswith("step-")),
            key=lambda p: int(p.name.split("-")[1]),
        )
        assert int(newest.name.split("-")[1]) > NOTICE_AT  # the emergency checkpoint
        assert newest.name in listed.stdout

        # A fresh node: restore --latest, byte for byte what the first node saved.
        second = ExecNode(
            tmp_path / "node-b", SPEC, env, extra_config=POLICY, preemption=PREEMPTION
        )
        restored = run_cli(
            "restore", *cli, "--run", RUN_ID, "--latest", "--to", str(second.ckpt), env=user
        )
        assert restored.returncode == 0, restored.stderr
        assert _files(second.ckpt / newest.name) == _files(newest)

        # The trainer resumes there, under exec, and runs to its end.
        try:
            second.start()
            assert second.wait_exit(240) == 0, second.log_tail()
        finally:
            second.close()
        result = json.loads(second.result.read_text())
        assert result["step"] == SPEC.max_steps and not result["preempted"], result
        resumed = [e for e in second.events("trainer_started") if e.get("resume_from")]
        assert resumed and resumed[0]["resume_from"].endswith(newest.name), resumed

        # Housekeeping: retention kept 2; prune finds nothing more; rm takes one by hand;
        # check says the fresh node's copies are what the store holds.
        later = ("--config", str(second.config))
        pruned = run_cli("prune", *later, "--yes", "--json", env=user)
        assert pruned.returncode == 0, pruned.stderr
        assert [a["kind"] for a in json.loads(pruned.stdout)["tiers"][0]["actions"]] == []
        checked = run_cli("check", *later, env=user)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        final = f"step-{SPEC.max_steps}"
        kept = [
            c["checkpoint"]
            for c in json.loads(run_cli("list", *later, "--json", env=user).stdout)["checkpoints"]
        ]
        assert len(kept) == 2 and final in kept, kept
        older = next(name for name in kept if name != final)
        removed = run_cli("rm", *later, f"{RUN_ID}/{older}", "--yes", env=user)
        assert removed.returncode == 0, removed.stderr
        after = run_cli("list", *later, "--run", RUN_ID, env=user).stdout
        assert older not in after and final in after

        # The report: two attempts, the notice, steps counted as productive.
        report = run_cli("report", *later, "--run", RUN_ID, env=user)
        assert report.returncode == 0, report.stderr
        assert "no step reports" not in report.stdout
        assert "interruptions 1" in report.stdout and "notice" in report.stdout, report.stdout
