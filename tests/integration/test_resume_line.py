"""Where a restarted trainer resumes after rollbacks (``ckptd.sync.resume``,
``ckptd.sync.lineage``): the newest complete local checkpoint on the live line, on a real
``file://`` store and a real journal, for the instants the ``ckptd exec`` process tests
(``tests/process/test_exec_rollback_resume.py``) do not reach: a line whose middle
trajectory this node never ran (known from the store only), and what ckptd's own report
of a save not committed yet decides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckptd.commit.lineage import Resumed, decide
from ckptd.core import checksum, handoff
from ckptd.core.manifest import ForkPoint, Latest, Manifest, Trajectory, build_manifest
from ckptd.layouts.base import RuleSettings
from ckptd.repository import Repository
from ckptd.storage.fs import FileStorage
from ckptd.sync.journal import Journal
from ckptd.sync.lineage import Attempt, RunLineage
from ckptd.sync.request import fingerprint_id
from ckptd.sync.resume import find_resume_point
from ckptd.sync.scanner import snapshot
from tests.support.writers import write_hf

RUN = "run"
RULES = RuleSettings(quiescence_seconds=0.0, marker=None, settle_seconds=0.0)
ORIGINAL = Trajectory(id="", generation=0)


class Events:
    """A logger that keeps what it is told: (event, fields)."""

    def __init__(self) -> None:
        self.said: list[tuple[str, dict[str, Any]]] = []

    def _say(self, event: str, **fields: Any) -> None:
        self.said.append((event, fields))

    info = warning = error = _say

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.said if name == event]


class Node:
    """A node's watch dir and journal; every node of a test shares one ``file://`` store."""

    def __init__(self, tmp: Path, name: str = "node") -> None:
        self.watch = tmp / name / "run"
        self.watch.mkdir(parents=True)
        self.repo = Repository(FileStorage(tmp / "store"))
        self.journal = Journal(tmp / name / "state")
        self.log = Events()

    def lineage(self) -> RunLineage:
        """The run's lineage as a daemon started now reads it from the journal."""
        return RunLineage(RUN, self.watch, self.repo, self.journal, self.log)

    def save(self, step: int) -> Path:
        """A complete HF checkpoint in the watch dir, its files' mtimes now."""
        path = self.watch / f"checkpoint-{step}"
        if path.exists():
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
        return write_hf(self.watch, step, model_bytes=4096)

    def commit(
        self, step: int, trajectory: Trajectory, slot: str | None = None, *, latest: bool = True
    ) -> Manifest:
        """Commit the local ``checkpoint-<step>`` as ``slot`` on ``trajectory``, as this
        node's daemon would (manifest, journal, LATEST)."""
        name = f"checkpoint-{step}"
        listing = snapshot(self.watch, name)
        assert listing is not None
        files = [
            (
                f.path,
                f.size,
                checksum.to_hex(checksum.crc32c((self.watch / name / f.path).read_bytes())),
            )
            for f in listing.files
        ]
        manifest = build_manifest(
            run_id=RUN,
            checkpoint=slot or name,
            step=step,
            layout="hf",
            host="h",
            created_at=0,
            committed_at=0,
            files=files,
            environment={},
            name=name,
            trajectory=trajectory,
        )
        body = manifest.to_bytes()
        self.repo.put_manifest_if_absent(manifest, body, checksum.crc32c(body))
        self.journal.mark_committed(
            RUN, name, step, slot=slot or name, fingerprint=fingerprint_id(listing.files)
        )
        if latest:
            self.repo.write_latest(
                RUN,
                Latest(
                    checkpoint=manifest.checkpoint,
                    step=step,
                    manifest_crc32c=checksum.to_hex(checksum.crc32c(body)),
                    trajectory=trajectory.id or None,
                    generation=trajectory.generation or None,
                ),
            )
        return manifest

    def started(self, trajectory: Trajectory, at: float) -> None:
        """A trainer start decided on ``trajectory`` at ``at``, kept in the journal."""
        attempt = Attempt(at, f"1:{at:.6f}", trajectory, None)
        self.journal.record_attempt(RUN, at, attempt.report, attempt.to_json())

    def resume_point(self, lineage: RunLineage) -> str | None:
        latest = self.repo.read_latest(RUN)
        live = self.repo.read_manifest(RUN, latest.checkpoint) if latest else None
        line = lineage.live_line(live)
        on_line = None if line is None else lineage.on_line(line, live)
        point = find_resume_point(self.watch, "hf", RULES, 2**62, on_line)
        return None if point.checkpoint is None else point.checkpoint.path.name


def fork(parent: Manifest, latest: Manifest) -> Trajectory:
    """The trajectory a trainer resuming from ``parent`` while LATEST names ``latest``
    starts (``ckptd.commit.lineage.decide``)."""
    pointer = Latest(
        checkpoint=latest.checkpoint,
        step=latest.step,
        manifest_crc32c="00000000",
        trajectory=latest.lineage.id or None,
        generation=latest.lineage.generation or None,
    )
    return decide(Resumed(parent), pointer, latest)


def test_the_line_through_a_trajectory_this_node_never_ran_is_read_from_the_store(
    tmp_path: Path,
) -> None:
    """This node trained the original line to 60; another node then rolled back twice:
    to 40 (saving 50 and 60 on T1), then to T1's 50 (saving 70 on T2, which LATEST
    names). This node's journal knows none of those starts, and its watch dir holds the
    original 20, 40 and 60 only. T1's fork point is read from the store: the original
    line is live up to 40, so the trainer resumes from 40, not from the abandoned 60 and
    not from nothing."""
    node, other = Node(tmp_path), Node(tmp_path, "other")
    for step in (20, 40, 60):
        node.save(step)
        node.commit(step, ORIGINAL)
    forty = node.repo.read_manifest(RUN, "checkpoint-40")
    sixty = node.repo.read_manifest(RUN, "checkpoint-60")
    assert forty is not None and sixty is not None
    first = fork(forty, sixty)
    other.save(50)
    fifty = other.commit(50, first, f"checkpoint-50~{first.id}")
    other.save(60)
    sixty_first = other.commit(60, first, f"checkpoint-60~{first.id}")
    second = fork(fifty, sixty_first)
    assert second.generation == 2 and second.forked_from == ForkPoint(
        checkpoint=fifty.checkpoint, step=50, trajectory=first.id
    )
    other.save(70)
    latest = other.commit(70, second)
    lineage = node.lineage()
    assert lineage.attempts == []
    assert lineage.live_line(latest) == {second.id: None, first.id: 50, "": 40}
    assert node.resume_point(lineage) == "checkpoint-40"
    # Without the line (every complete checkpoint counts), the abandoned 60 would win.
    unfiltered = find_resume_point(node.watch, "hf", RULES, 2**62)
    assert unfiltered.checkpoint is not None and unfiltered.checkpoint.path.name == "checkpoint-60"


def rolled_back_to_40_with_50_saved(tmp_path: Path) -> tuple[Node, Trajectory, RunLineage]:
    """The original line committed to 60 (LATEST); then a start rolled back to 40 (on T,
    one generation up) and saved 50, not committed yet. The node, T, and the run's
    lineage as a daemon started now reads it."""
    node = Node(tmp_path)
    for step in (40, 60):
        node.save(step)
        node.commit(step, ORIGINAL)
    forty = node.repo.read_manifest(RUN, "checkpoint-40")
    sixty = node.repo.read_manifest(RUN, "checkpoint-60")
    assert forty is not None and sixty is not None
    rollback = fork(forty, sixty)
    node.started(ORIGINAL, 1.0)
    node.started(rollback, 2.0)  # before the 50's files (written now)
    node.save(50)
    lineage = node.lineage()
    assert lineage.live_head(sixty) == rollback
    return node, rollback, lineage


def ckptd_reports_50(node: Node, lineage: RunLineage) -> Attempt | None:
    """ckptd's own report (``by: ckptd``) of the trainer started from the 50, decided."""
    now = os.stat(node.watch / "checkpoint-50" / "trainer_state.json").st_mtime + 10
    handoff.replace_json(
        node.watch / handoff.RESUMED,
        {"checkpoint": "checkpoint-50", "pid": 0, "at": now, "by": handoff.RESUMED_BY_CKPTD},
    )
    return lineage.refresh()


def test_ckptds_choice_of_an_uncommitted_rollback_save_continues_its_trajectory(
    tmp_path: Path,
) -> None:
    """The trainer rolled back to 40 (its start decided on T, one generation up) and saved
    50, not committed yet; LATEST names the original 60, whose local copy is the highest
    step. The resume point is the 50, and ckptd's report of it (``by: ckptd``) decides T
    for the next start: no fork of a third line, no rollback said."""
    node, rollback, lineage = rolled_back_to_40_with_50_saved(tmp_path)
    assert node.resume_point(lineage) == "checkpoint-50"
    decided = ckptd_reports_50(node, lineage)
    assert decided is not None and decided.trajectory == rollback
    assert node.log.named("trainer_resumed")[-1]["by"] == "ckptd"
    assert not node.log.named("trainer_rolled_back")
    assert not node.log.named("resume_point_behind_latest")


def test_the_trainers_own_report_of_an_uncommitted_rollback_save_stays_on_its_line(
    tmp_path: Path,
) -> None:
    """As above, and then the trainer's own report of the same 50 (its helper's, not
    ``by: ckptd``) before the 50 commits: still T, so its next save, 60, is T's 60, not
    the original line's (a loaded CI rehearsal took it for the original's, and the new
    60 then conflicted with the committed one for good)."""
    node, rollback, lineage = rolled_back_to_40_with_50_saved(tmp_path)
    assert ckptd_reports_50(node, lineage) is not None
    now = os.stat(node.watch / "checkpoint-50" / "trainer_state.json").st_mtime + 11
    handoff.replace_json(
        node.watch / handoff.RESUMED, {"checkpoint": "checkpoint-50", "pid": 1, "at": now}
    )
    decided = lineage.refresh()
    assert decided is not None and decided.trajectory == rollback
    resumed = node.log.named("trainer_resumed")[-1]
    assert resumed["trajectory"] == rollback.id and "by" not in resumed, resumed
    assert not node.log.named("trainer_rolled_back")


def test_ckptds_choice_behind_the_live_lines_newest_forks_and_says_so(tmp_path: Path) -> None:
    """LATEST names 60 and its local copy is gone: ckptd hands the trainer 40, the newest
    left on the line. Its saves from 40 cannot be the line's 50 and 60 again, so its
    start forks a new trajectory, said as ckptd's (``resume_point_behind_latest``), not
    as a rollback the trainer reported."""
    node = Node(tmp_path)
    for step in (20, 40, 60):
        node.save(step)
        node.commit(step, ORIGINAL)
    node.started(ORIGINAL, 1.0)
    for f in (node.watch / "checkpoint-60").iterdir():
        f.unlink()
    (node.watch / "checkpoint-60").rmdir()
    lineage = node.lineage()
    assert node.resume_point(lineage) == "checkpoint-40"
    handoff.replace_json(
        node.watch / handoff.RESUMED,
        {"checkpoint": "checkpoint-40", "pid": 0, "at": 3.0, "by": handoff.RESUMED_BY_CKPTD},
    )
    decided = lineage.refresh()
    assert decided is not None and decided.trajectory.generation == 1
    assert decided.trajectory.forked_from is not None
    assert decided.trajectory.forked_from.checkpoint == "checkpoint-40"
    [said] = node.log.named("resume_point_behind_latest")
    assert said["latest"] == "checkpoint-60"
    assert not node.log.named("trainer_rolled_back")


def test_the_line_is_asked_newest_first_and_only_until_one_holds(tmp_path: Path) -> None:
    """``on_line`` may read the store: it is asked for the complete checkpoints newest
    first, and no further once one is on the line."""
    node = Node(tmp_path)
    for step in (10, 20, 30, 40):
        node.save(step)
    asked: list[str] = []

    def on_line(listing: Any) -> bool:
        asked.append(listing.name)
        return listing.name != "checkpoint-40"

    point = find_resume_point(node.watch, "hf", RULES, 2**62, on_line)
    assert point.checkpoint is not None and point.checkpoint.path.name == "checkpoint-30"
    assert asked == ["checkpoint-40", "checkpoint-30"]
