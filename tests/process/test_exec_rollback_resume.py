"""``ckptd exec`` after a rollback: a crash, or exec and trainer killed and exec started
again, resumes the live trajectory, never a higher-step local copy of the abandoned one
(issue 44, item 4; docs/exec.md, docs/design.md "Trajectories").

The trainer (``tests/support/trainers/rollback_trainer.py``, real ``ckptd exec``, a
``file://`` store) trains to 60, is restarted, rolls back to 40 and saves 50, which
commits as ``checkpoint-50~<trajectory>``; the abandoned ``checkpoint-60`` stays in the
watch dir. Then, at several instants, the trainer crashes or both processes are killed
with SIGKILL and exec is started again. Every time the next start is handed the live
line's newest checkpoint (its name in ``CKPTD_RESUME_FROM`` and its bytes, as the trainer
read them), the saves after it continue that trajectory (no third generation), and the
store ends with LATEST on the live line, every live manifest and object intact, and
retention (``keep_last = 5``, the default) having deleted only abandoned or old ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ckptd.core import checksum
from tests.support.daemon import Daemon, run_cli, wait_until
from tests.support.trainers.procs import script_env

RUN = "run"
EXEC_SECONDS = 120  # a whole exec: five small saves and commits per line, three lines


class Node:
    """One node: its watch dir, state dir, ``file://`` store and the trainer's records."""

    def __init__(self, tmp_path: Path, plan: list[str], settle_seconds: float = 0.2) -> None:
        self.tmp = tmp_path
        self.dir = tmp_path / "node"
        self.watch = self.dir / "run"
        self.watch.mkdir(parents=True)
        self.store = self.dir / "store" / RUN
        self.seen = self.dir / "seen.jsonl"
        (self.dir / "plan.txt").write_text("\n".join(plan) + "\n")
        self.config = Daemon.configured(
            self.dir,
            watch=[{"dir": self.watch, "run_id": RUN, "settle_seconds": settle_seconds}],
            dest=f"file://{self.dir / 'store'}",
            state_dir=self.dir / "state",
        ).config
        self.logs: list[Path] = []

    def exec_command(self) -> list[str]:
        return [
            *(sys.executable, "-m", "ckptd", "exec", "--config", str(self.config), "--"),
            *(sys.executable, "-m", "tests.support.trainers.rollback_trainer"),
            *("--ckpt-dir", str(self.watch), "--store", str(self.dir / "store")),
            *("--plan", str(self.dir / "plan.txt"), "--attempts", str(self.dir / "attempts")),
            *("--kept", str(self.dir / "kept"), "--seen", str(self.seen)),
        ]

    def start_exec(self) -> subprocess.Popen[bytes]:
        log = self.dir / f"exec-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            return subprocess.Popen(
                self.exec_command(),
                env=script_env(self.tmp),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
            )

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-6000:] for p in self.logs)

    def events(self, event: str) -> list[dict[str, Any]]:
        found = []
        for path in self.logs:
            for line in path.read_text(errors="replace").splitlines():
                if f'"{event}"' not in line:
                    continue
                try:
                    doc = json.loads(line[line.index("{") :])
                except ValueError:
                    continue
                if doc.get("event") == event:
                    found.append(doc)
        return found

    def starts(self) -> list[dict[str, Any]]:
        """What each trainer start was handed (one JSON line each)."""
        if not self.seen.exists():
            return []
        return [json.loads(line) for line in self.seen.read_text().splitlines() if line]

    def latest(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.store / "LATEST").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None

    def manifest(self, slot: str) -> dict[str, Any] | None:
        try:
            doc = json.loads((self.store / slot / "ckptd.manifest.json").read_text())
        except (OSError, ValueError):
            return None
        return doc if doc.get("format") == "ckptd.manifest/1" else None

    def slots(self) -> list[str]:
        return sorted(p.parent.name for p in self.store.glob("*/ckptd.manifest.json"))

    def wait_exit(self, proc: subprocess.Popen[bytes]) -> int:
        try:
            return proc.wait(timeout=EXEC_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"exec did not finish:\n{self.log_text()}") from None

    def kill_exec_and_trainer(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL to exec and its trainer (the newest start's PID), at the same instant."""
        trainer = self.starts()[-1]["pid"]
        os.kill(proc.pid, signal.SIGKILL)
        os.kill(trainer, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_until(lambda: not _alive(trainer), 30, "the trainer gone")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def _model_crc(path: Path) -> str:
    return checksum.to_hex(checksum.crc32c((path / "model.safetensors").read_bytes()))


def rollback_slot(node: Node, name: str) -> str:
    """The slot the rollback's save of ``name`` committed in: its home when the first
    line never saved that name, else ``name~<letters>``; on a trajectory other than the
    run's first, whichever it is."""
    found = []
    for slot in node.slots():
        doc = node.manifest(slot)
        if (
            doc is not None
            and (doc.get("name") or doc["checkpoint"]) == name
            and (doc.get("trajectory") or {}).get("id")
        ):
            found.append(slot)
    assert len(found) == 1, (name, found, node.slots())
    return found[0]


def check_resumed_live_line(node: Node, start: int, slot: str) -> None:
    """Start ``start`` was handed the local copy of ``slot``: its name and its bytes."""
    handed = node.starts()[start]
    manifest = node.manifest(slot)
    assert manifest is not None, f"{slot} not committed (yet), slots: {node.slots()}"
    local = manifest.get("name") or manifest["checkpoint"]
    assert handed["resume_from"] == str(node.watch / local), (handed, node.log_text())
    crc = {f["path"]: f["crc32c"] for f in manifest["files"]}["model.safetensors"]
    assert handed["model_crc32c"] == crc, f"start {start} was handed other bytes than {slot}"


def check_store(node: Node, latest_name: str, live: dict[str, int]) -> None:
    """LATEST names ``latest_name`` on the rollback's trajectory; ``live`` (slot -> step)
    are committed, on the live line, with every object the manifest names, byte for byte
    as the manifest says; nothing of a third generation; what retention kept is the five
    newest live checkpoints."""
    latest = node.latest()
    assert latest is not None
    head = node.manifest(latest["checkpoint"])
    assert head is not None
    trajectory = head["trajectory"]
    assert trajectory["generation"] == 1 and trajectory["forked_from"]["checkpoint"] == (
        "checkpoint-40"
    ), trajectory
    assert (latest["checkpoint"], latest["generation"]) == (latest_name, 1), latest
    for slot, step in live.items():
        manifest = node.manifest(slot)
        assert manifest is not None, f"{slot} missing; slots: {node.slots()}"
        assert manifest["step"] == step
        lineage = manifest.get("trajectory") or {"id": "", "generation": 0}
        assert lineage["id"] in ("", trajectory["id"]), (slot, lineage)
        for f in manifest["files"]:
            data = (node.store / slot / f["path"]).read_bytes()
            assert len(data) == f["size"], (slot, f["path"])
            assert checksum.to_hex(checksum.crc32c(data)) == f["crc32c"], (slot, f["path"])
    for slot in node.slots():
        doc = node.manifest(slot)
        assert doc is not None
        assert (doc.get("trajectory") or {}).get("generation", 0) <= 1, (slot, doc["trajectory"])
    listed = run_cli("list", "--run", RUN, "--json", config=node.config)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    kept_live = sorted(str(r["checkpoint"]) for r in rows if not r["abandoned"])
    assert kept_live == sorted(live), (kept_live, node.slots())
    assert not node.events("trainer_rolled_back") or all(
        e.get("resumed_from") == "checkpoint-40" for e in node.events("trainer_rolled_back")
    ), node.events("trainer_rolled_back")


def test_a_trainer_crash_after_a_rollback_resumes_the_live_line(tmp_path: Path) -> None:
    """Trains to 60, rolls back to 40, saves 50 (committed as 50~T) and crashes; exec
    starts it again from that 50, not from the abandoned 60 beside it."""
    node = Node(tmp_path, ["save 20 30 40 50 60", "rollback checkpoint-40 50", "save 60 70"])
    code = node.wait_exit(node.start_exec())
    assert code == 0, node.log_text()
    fifty = rollback_slot(node, "checkpoint-50")
    check_resumed_live_line(node, 2, fifty)
    sixty = rollback_slot(node, "checkpoint-60")
    live = {"checkpoint-30": 30, "checkpoint-40": 40, fifty: 50, sixty: 60, "checkpoint-70": 70}
    check_store(node, "checkpoint-70", live)


def kill_then_exec_again(node: Node, ready: Any, what: str) -> int:
    """Run exec until ``ready()``, SIGKILL it and its trainer, run exec again to its end."""
    first = node.start_exec()
    try:
        wait_until(ready, EXEC_SECONDS, what, details=node.log_text)
    finally:
        node.kill_exec_and_trainer(first)
    return node.wait_exit(node.start_exec())


def test_exec_and_trainer_killed_after_a_committed_rollback_resume_the_live_line(
    tmp_path: Path,
) -> None:
    """Both killed with SIGKILL once 50~T is committed and LATEST names it, the abandoned
    60 beside it: the next exec restores nothing and starts the trainer from that 50."""
    plan = ["save 20 30 40 50 60", "rollback checkpoint-40 50 hang", "save 60 70"]
    node = Node(tmp_path, plan)

    def rollback_committed() -> bool:
        latest = node.latest() or {}
        return len(node.starts()) == 2 and str(latest.get("checkpoint")).startswith(
            "checkpoint-50~"
        )

    code = kill_then_exec_again(node, rollback_committed, "the rollback's 50 committed")
    assert code == 0, node.log_text()
    fifty = rollback_slot(node, "checkpoint-50")
    check_resumed_live_line(node, 2, fifty)
    [skipped] = [e for e in node.events("exec_restore_skipped")]
    assert skipped["local"] == "checkpoint-50", skipped
    sixty = rollback_slot(node, "checkpoint-60")
    live = {"checkpoint-30": 30, "checkpoint-40": 40, fifty: 50, sixty: 60, "checkpoint-70": 70}
    check_store(node, "checkpoint-70", live)


def test_exec_and_trainer_killed_after_a_rollback_report_before_its_first_save(
    tmp_path: Path,
) -> None:
    """Both killed after the trainer reported its rollback to 40 and before it saved
    anything: LATEST still names the old 60. The next exec decides the report first
    (before its own start's report replaces it), so the line is the rollback's: the next
    start is handed 40, and its saves continue that very trajectory, which LATEST then
    follows."""
    plan = ["save 20 30 40 50 60", "rollback checkpoint-40 hang", "save 50 60"]
    node = Node(tmp_path, plan)

    def rollback_reported() -> bool:
        try:
            report = json.loads((node.watch / ".ckptd" / "resumed.json").read_text())
        except (OSError, ValueError):
            return False
        starts = node.starts()
        return len(starts) == 2 and report.get("pid") == starts[1]["pid"]

    code = kill_then_exec_again(node, rollback_reported, "the rollback reported")
    assert code == 0, node.log_text()
    [reported] = node.events("trainer_rolled_back")
    assert reported["resumed_from"] == "checkpoint-40", reported
    handed = node.starts()[2]
    assert handed["resume_from"] == str(node.watch / "checkpoint-40"), handed
    forty = node.manifest("checkpoint-40")
    assert forty is not None
    assert (
        handed["model_crc32c"]
        == {f["path"]: f["crc32c"] for f in forty["files"]}["model.safetensors"]
    )
    fifty, sixty = rollback_slot(node, "checkpoint-50"), rollback_slot(node, "checkpoint-60")
    sixty_doc = node.manifest(sixty)
    assert sixty_doc is not None and sixty_doc["trajectory"]["id"] == reported["trajectory"]
    assert not node.events("resume_point_behind_latest"), node.log_text()
    live = {"checkpoint-20": 20, "checkpoint-30": 30, "checkpoint-40": 40, fifty: 50, sixty: 60}
    check_store(node, sixty, live)


def test_exec_and_trainer_killed_before_the_rollbacks_first_save_commits(
    tmp_path: Path,
) -> None:
    """Both killed once the rollback's 50 is saved, inside its quiet window (settle 2.5 s),
    so before it is committed: LATEST still names the old 60, whose local copy is the
    highest step. The next exec hands the trainer that 50 (a save of the rollback's start,
    not committed yet), ships it on the rollback's trajectory, and the trainer's saves
    after it continue that trajectory."""
    node = Node(
        tmp_path,
        ["save 40 60", "rollback checkpoint-40 50 nowait hang", "save 60 70"],
        settle_seconds=2.5,
    )

    def fifty_saved() -> bool:
        return (
            len(node.starts()) == 2 and (node.watch / "checkpoint-50/trainer_state.json").exists()
        )

    first = node.start_exec()
    try:
        wait_until(fifty_saved, EXEC_SECONDS, "the rollback's 50 saved", 0.01, node.log_text)
    finally:
        node.kill_exec_and_trainer(first)
    # The instant this test is about: the 50 is complete here and committed nowhere.
    assert [s for s in node.slots() if s.startswith("checkpoint-50")] == [], node.slots()
    assert (node.latest() or {}).get("checkpoint") == "checkpoint-60"
    handed_bytes = _model_crc(node.watch / "checkpoint-50")
    code = node.wait_exit(node.start_exec())
    assert code == 0, node.log_text()
    fifty = rollback_slot(node, "checkpoint-50")
    check_resumed_live_line(node, 2, fifty)
    assert node.starts()[2]["model_crc32c"] == handed_bytes
    sixty = rollback_slot(node, "checkpoint-60")
    check_store(
        node, "checkpoint-70", {"checkpoint-40": 40, fifty: 50, sixty: 60, "checkpoint-70": 70}
    )
    assert not node.events("resume_point_behind_latest"), node.log_text()
