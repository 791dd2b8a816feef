"""A trainer that rolls back (docs/design.md "Trajectories"): 20, 40 and 60 committed; the
trainer resumes from 40 and saves 50 and 60 again. The new checkpoints commit, the new 60
under its own slot; ``restore --latest`` returns the new 60 byte for byte; the old 60 is
listed as abandoned and restores by name, byte for byte. In sidecar mode (``ckptd run``
beside the trainer) and under ``ckptd exec``. A trainer restarted from scratch under a run
that has checkpoints is loud at its start and at its first commit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.trainers.procs import script_env
from tests.support.writers import local_files, write_hf

RUN = "run"


def trainer(node: Path, plan: list[str]) -> list[str]:
    (node / "plan.txt").write_text("\n".join(plan) + "\n")
    return [
        sys.executable,
        "-m",
        "tests.support.trainers.rollback_trainer",
        "--ckpt-dir",
        str(node / "run"),
        "--store",
        str(node / "store"),
        "--plan",
        str(node / "plan.txt"),
        "--attempts",
        str(node / "attempts"),
        "--kept",
        str(node / "kept"),
    ]


def daemon(node: Path) -> Daemon:
    """The node's daemon (started by ``with``), whose config the CLI and exec use too."""
    return Daemon.configured(
        node,
        watch=[{"dir": node / "run", "run_id": RUN, "settle_seconds": 0.2}],
        dest=f"file://{node / 'store'}",
        state_dir=node / "state",
    )


def check_rolled_back(node: Path) -> None:
    """The verdict shared by both modes, read from the store through the CLI."""
    cfg = node / "daemon.toml"
    listed = run_cli("list", "--run", RUN, "--json", config=cfg)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    by_name: dict[str, list[dict[str, object]]] = {}
    for row in rows:
        by_name.setdefault(str(row["name"]), []).append(row)
    assert sorted(by_name) == ["checkpoint-20", "checkpoint-40", "checkpoint-50", "checkpoint-60"]
    old, new = sorted(by_name["checkpoint-60"], key=lambda r: str(r["checkpoint"]))
    assert old["checkpoint"] == "checkpoint-60" and old["abandoned"] is True
    assert str(new["checkpoint"]).startswith("checkpoint-60~") and new["abandoned"] is False
    assert new["latest"] is True and new["trajectory"] != ""
    for name in ("checkpoint-20", "checkpoint-40", "checkpoint-50"):
        assert [r["abandoned"] for r in by_name[name]] == [False], name
    # restore --latest: the new 60, byte for byte.
    latest = run_cli("restore", "--run", RUN, "--latest", "--to", str(node / "latest"), config=cfg)
    assert latest.returncode == 0, latest.stderr
    restored = local_files(node / "latest" / "checkpoint-60")
    assert restored == local_files(node / "run" / "checkpoint-60")
    # The abandoned 60 restores by its slot, byte for byte as it was written.
    by_slot = run_cli(
        "restore",
        "--run",
        RUN,
        "--checkpoint",
        "checkpoint-60",
        "--to",
        str(node / "old"),
        config=cfg,
    )
    assert by_slot.returncode == 0, by_slot.stderr
    [kept] = list((node / "kept").iterdir())
    assert local_files(node / "old" / "checkpoint-60") == local_files(kept)
    assert local_files(kept) != restored


def test_a_rollback_in_sidecar_mode_commits_and_latest_follows_it(tmp_path: Path) -> None:
    node = tmp_path / "node"
    (node / "run").mkdir(parents=True)
    command = trainer(node, ["save 20 40 60", "rollback checkpoint-40 50 60"])
    with daemon(node) as beside:
        for _ in range(2):  # the trainer's two lives, under whatever restarts it
            done = subprocess.run(
                command, env=script_env(tmp_path), capture_output=True, text=True, timeout=300
            )
            assert done.returncode in (0, 3), done.stderr
        wait_until(
            lambda: beside.events_named("checkpoint_starts_trajectory"),
            60,
            "the rollback's first commit said",
            details=beside.log_text,
        )
        assert beside.events_named("trainer_rolled_back")
    check_rolled_back(node)


def test_a_rollback_under_exec_commits_and_latest_follows_it(tmp_path: Path) -> None:
    node = tmp_path / "node"
    (node / "run").mkdir(parents=True)
    cfg = daemon(node).config
    command = trainer(node, ["save 20 40 60", "rollback checkpoint-40 50 60"])
    done = subprocess.run(
        [sys.executable, "-m", "ckptd", "exec", "--config", str(cfg), "--", *command],
        env=script_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint_starts_trajectory" in done.stderr
    check_rolled_back(node)


def test_a_trainer_restarted_from_scratch_under_a_run_with_checkpoints_is_loud(
    tmp_path: Path,
) -> None:
    node = tmp_path / "node"
    (node / "run").mkdir(parents=True)
    command = trainer(node, ["save 20 40", "scratch 10"])
    with daemon(node) as beside:
        for _ in range(2):
            done = subprocess.run(
                command, env=script_env(tmp_path), capture_output=True, text=True, timeout=300
            )
            assert done.returncode in (0, 3), done.stderr
        said = wait_until(
            lambda: beside.events_named("checkpoint_starts_trajectory"),
            60,
            "the first commit from scratch said",
            details=beside.log_text,
        )
        assert beside.events_named("trainer_started_from_scratch")
    assert said[0]["from_scratch"] is True and said[0]["previous_latest"] == "checkpoint-40"
    latest = json.loads((node / "store" / RUN / "LATEST").read_text())
    assert latest["checkpoint"] == "checkpoint-10" and latest["generation"] == 1


def test_a_save_below_latest_without_a_known_parent_commits_and_leaves_latest_loudly(
    tmp_path: Path,
) -> None:
    """A trainer without the helpers (no resume report): a save whose step is below
    LATEST's commits when its name is free, never moves LATEST, and says why."""
    node = tmp_path / "node"
    (node / "run").mkdir(parents=True)
    with daemon(node) as beside:
        write_hf(node / "run", 60)
        wait_until(
            lambda: beside.events_named("checkpoint_committed", checkpoint="checkpoint-60"),
            60,
            "60",
        )
        write_hf(node / "run", 30)
        said = wait_until(lambda: beside.events_named("latest_not_moved"), 60, "LATEST left, said")
    assert said[0]["latest"] == "checkpoint-60" and "report_resumed" in said[0]["reason"]
    assert (node / "store" / RUN / "checkpoint-30" / "ckptd.manifest.json").is_file()
    assert (
        json.loads((node / "store" / RUN / "LATEST").read_text())["checkpoint"] == "checkpoint-60"
    )
