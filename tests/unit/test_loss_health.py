"""The training's own health: the loss the trainer reports with its steps (the ring the
helper writes, the daemon reads), the loss-spike rule (``ckptd.health.loss``), and the
protection that keeps a spike's rollback target from retention (a lease with an
``until``, ``ckptd.daemon.loss_watch``)."""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from ckptd.core import checksum
from ckptd.core.handoff import LOSS_LAYOUT, LOSSES
from ckptd.core.manifest import Latest, Manifest, build_manifest
from ckptd.daemon.loss_watch import LossWatch
from ckptd.goodput.step_report import read_losses
from ckptd.health.loss import LossRule, LossTracker
from ckptd.repository import Repository, lease_is_fresh, lease_why
from ckptd.runtime.clock import SYSTEM_CLOCK
from ckptd.runtime.metrics import Metrics
from ckptd.storage.fs import FileStorage
from ckptd.store.retention import plan_retention
from ckptd.trainer import steps


def noisy(n: int, seed: int = 1, level: float = 2.0) -> list[float]:
    """A training loss slowly falling with noise: no spike in it."""
    rng = random.Random(seed)
    return [level - 0.001 * i + rng.gauss(0, 0.02) for i in range(n)]


# -- the rule ------------------------------------------------------------------------------


def test_a_noisy_falling_loss_is_never_a_spike() -> None:
    tracker = LossTracker(LossRule())
    events = [tracker.observe(i, x) for i, x in enumerate(noisy(2000))]
    assert [e for e in events if e is not None] == []
    assert not tracker.volatile


def test_a_jump_far_above_the_window_is_one_spike_at_its_step() -> None:
    tracker = LossTracker(LossRule(window=50, z=6.0, min_reports=20))
    for i, x in enumerate(noisy(100)):
        assert tracker.observe(i, x) is None
    event = tracker.observe(100, 9.0)
    assert event is not None and event.kind == "spike" and event.step == 100
    assert event.z is not None and event.z > 6 and 1.8 < event.mean < 2.0
    # The next bad reports belong to the same episode: no second event of a kind...
    assert tracker.observe(101, 8.0) is None and tracker.observe(102, 9.5) is None
    # ... but the first NaN in it is one: the training got worse.
    nan = tracker.observe(103, float("nan"))
    assert nan is not None and nan.kind == "non-finite" and nan.step == 103
    assert tracker.observe(104, float("nan")) is None and tracker.observe(105, 9.0) is None
    assert tracker.volatile


def test_no_spike_is_judged_before_the_minimum_of_reports_but_nan_always_is() -> None:
    tracker = LossTracker(LossRule(window=50, z=6.0, min_reports=20))
    for i, x in enumerate(noisy(10)):
        tracker.observe(i, x)
    assert tracker.observe(10, 100.0) is None  # 10 reports: not judged yet
    event = tracker.observe(11, float("inf"))
    assert event is not None and event.kind == "non-finite"


def test_the_episode_ends_stable_after_a_window_of_normal_reports() -> None:
    tracker = LossTracker(LossRule(window=30, z=6.0, min_reports=20))
    losses = noisy(200)
    for i, x in enumerate(losses[:100]):
        tracker.observe(i, x)
    assert tracker.observe(100, 50.0) is not None
    kinds = [tracker.observe(101 + i, x) for i, x in enumerate(losses[100:140])]
    found = [(i, e.kind) for i, e in enumerate(kinds) if e is not None]
    assert found == [(29, "stable")]  # the 30th normal report in a row
    assert not tracker.volatile


def test_a_loss_that_settles_higher_is_the_new_baseline_without_a_stable() -> None:
    tracker = LossTracker(LossRule(window=30, z=6.0, min_reports=20))
    for i, x in enumerate(noisy(100)):
        tracker.observe(i, x)
    higher = noisy(100, seed=2, level=5.0)
    events = [tracker.observe(100 + i, x) for i, x in enumerate(higher)]
    assert [e.kind for e in events if e is not None] == ["spike"]
    assert not tracker.volatile  # re-based on the new level, no "stable" said
    assert tracker.observe(300, 50.0) is not None  # and judging again from there


def test_a_flat_loss_does_not_turn_a_wiggle_into_a_spike() -> None:
    tracker = LossTracker(LossRule())
    for i in range(100):
        tracker.observe(i, 1.0)
    assert tracker.observe(100, 1.003) is None  # std 0: the relative floor judges it
    assert tracker.observe(101, 1.5) is not None


def test_a_rule_that_cannot_judge_is_refused() -> None:
    with pytest.raises(ValueError):
        LossRule(window=10, min_reports=20)
    with pytest.raises(ValueError):
        LossRule(z=0)


# -- the ring ------------------------------------------------------------------------------


@pytest.fixture
def fresh_reporter() -> Any:
    steps._forget()
    yield
    steps._forget()


def test_reported_losses_reach_the_daemon_in_order_with_their_steps(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    for step in range(1, 11):
        steps.report_step(step, tmp_path, loss=1.0 / step)
    steps.report_step(11, tmp_path)  # no loss: the ring is left as it is
    steps.report_step(12, tmp_path, loss=float("nan"))
    reports, after = read_losses(tmp_path, 0)
    assert [r.step for r in reports] == [*range(1, 11), 12]
    assert reports[0].loss == 1.0 and math.isnan(reports[-1].loss) and after == 11
    more, again = read_losses(tmp_path, after)
    assert (more, again) == ([], 11)


def test_a_lapped_ring_hands_over_only_what_it_still_holds(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    total = LOSS_LAYOUT.SLOTS + 100
    for step in range(1, total + 1):
        steps.report_step(step, tmp_path, loss=float(step))
    reports, after = read_losses(tmp_path, 0)
    assert after == total and len(reports) == LOSS_LAYOUT.SLOTS
    assert [r.step for r in reports] == list(range(101, total + 1))
    assert all(r.loss == float(r.step) for r in reports)


def test_a_record_being_written_is_skipped_never_taken_for_another(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    for step in range(1, 4):
        steps.report_step(step, tmp_path, loss=0.5)
    data = bytearray((tmp_path / LOSSES).read_bytes())
    LOSS_LAYOUT.RECORD.pack_into(data, LOSS_LAYOUT.record(2), 999, 2, 7.0)  # torn: wrong tag
    reports, _ = LOSS_LAYOUT.decode(bytes(data), 0)
    assert [r.step for r in reports] == [1, 3]


def test_the_next_trainer_counts_on_and_the_json_fallback_carries_the_loss(
    tmp_path: Path, fresh_reporter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps.report_step(1, tmp_path, loss=3.0)
    steps._forget()  # as a new process
    steps.report_step(2, tmp_path, loss=2.0)
    reports, _ = read_losses(tmp_path, 1)
    assert [(r.n, r.step, r.loss) for r in reports] == [(2, 2, 2.0)]
    json_report = steps._JsonReport(tmp_path / "steps.json", 5, 0.0)
    json_report.every = 0
    json_report.write(5, 1.0, float("nan"))
    assert json.loads((tmp_path / "steps.json").read_text())["loss"] == "nan"


# -- the protection ------------------------------------------------------------------------


def test_a_protection_holds_until_its_time_and_says_why() -> None:
    body = json.dumps({"checkpoint": "c", "taken_at": 0.0, "until": 100.0, "why": "x"}).encode()
    assert lease_is_fresh(body, now=99.0, ttl=1.0) and not lease_is_fresh(body, now=100.0)
    assert lease_why(body) == "x"
    assert lease_why(json.dumps({"checkpoint": "c", "taken_at": 0.0}).encode()) == "restore"


def commit(repo: Repository, step: int) -> Manifest:
    name = f"checkpoint-{step}"
    manifest = build_manifest(
        run_id="run",
        checkpoint=name,
        step=step,
        layout="hf",
        host="h",
        created_at=0,
        committed_at=0,
        files=[("model.bin", 4, "00000000")],
        environment={},
    )
    body = manifest.to_bytes()
    repo.put_manifest_if_absent(manifest, body, checksum.crc32c(body))
    repo.write_latest("run", Latest(checkpoint=name, step=step, manifest_crc32c="00000000"))
    return manifest


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    info = warning


def test_a_spike_keeps_the_newest_checkpoint_before_it_until_the_loss_is_back(
    tmp_path: Path, fresh_reporter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptd.config.health import HealthConfig

    repo = Repository(FileStorage(tmp_path / "store"))
    watch = tmp_path / "run"
    for step in (10, 20, 30):
        commit(repo, step)
    metrics = Metrics()
    health = HealthConfig(loss_window=30, loss_min_reports=20)
    loss = LossWatch(health, {"run": watch}, repo, metrics, SYSTEM_CLOCK, Log())
    losses = noisy(200)
    for step in range(1, 26):
        steps.report_step(step, watch, loss=losses[step])
    steps.report_step(26, watch, loss=40.0)  # the spike, after checkpoint-20's step
    asyncio.run(loss.poll())
    now = SYSTEM_CLOCK.time()
    assert repo.read_protections("run", now=now) == {"checkpoint-20": "loss-spike"}
    fresh, _ = repo.read_leases("run", now=now)
    kept = plan_retention(
        [(f"checkpoint-{s}", s) for s in (10, 20, 30)],
        keep_last=1,
        keep_every_steps=0,
        protected=fresh,
    )
    assert kept == ["checkpoint-10"]  # checkpoint-20 stays, though keep_last = 1
    assert repo.read_protections("run", now=now + 24 * 3600 + 1) == {}  # runs out
    assert metrics.protected_checkpoints.labels(run="run")._value.get() == 1
    assert loss.status()["run"]["protected"] == ["checkpoint-20"]
    # The loss comes back for a window: the protection goes.
    for step in range(27, 60):
        steps.report_step(step, watch, loss=losses[step])
    asyncio.run(loss.poll())
    assert repo.read_protections("run", now=now) == {}
    assert metrics.protected_checkpoints.labels(run="run")._value.get() == 0
    spikes = metrics.loss_spikes.labels(run="run", kind="spike")._value.get()
    assert spikes == 1 and loss.status()["run"]["events"][-1]["kind"] == "stable"


def test_a_spike_before_any_checkpoint_below_it_protects_the_first_that_commits(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    from ckptd.config.health import HealthConfig

    repo = Repository(FileStorage(tmp_path / "store"))
    watch = tmp_path / "run"
    commit(repo, 50)
    loss = LossWatch(HealthConfig(), {"run": watch}, repo, Metrics(), SYSTEM_CLOCK, Log())
    steps.report_step(40, watch, loss=float("nan"))
    asyncio.run(loss.poll())
    assert repo.read_protections("run", now=SYSTEM_CLOCK.time()) == {}
    commit(repo, 30)  # another node's, say: below the NaN's step
    asyncio.run(loss.poll())
    assert repo.read_protections("run", now=SYSTEM_CLOCK.time()) == {"checkpoint-30": "non-finite"}


def test_a_checkpoint_below_the_spike_that_commits_after_it_becomes_the_target(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    """Step 25 was saved before the spike at 26 but was still shipping when the spike was
    seen: once it commits it is the rollback target, and 20's protection is let go."""
    from ckptd.config.health import HealthConfig

    repo = Repository(FileStorage(tmp_path / "store"))
    watch = tmp_path / "run"
    for step in (10, 20):
        commit(repo, step)
    log = Log()
    health = HealthConfig(loss_window=30, loss_min_reports=20)
    loss = LossWatch(health, {"run": watch}, repo, Metrics(), SYSTEM_CLOCK, log)
    losses = noisy(200)
    for step in range(1, 26):
        steps.report_step(step, watch, loss=losses[step])
    steps.report_step(26, watch, loss=40.0)
    asyncio.run(loss.poll())
    now = SYSTEM_CLOCK.time()
    assert repo.read_protections("run", now=now) == {"checkpoint-20": "loss-spike"}
    commit(repo, 25)
    asyncio.run(loss.poll())
    assert repo.read_protections("run", now=now) == {"checkpoint-25": "loss-spike"}
    assert loss.status()["run"]["protected"] == ["checkpoint-25"]
    assert ("rollback_target_moved", {"run": "run", "released": "checkpoint-20",
            "checkpoint": "checkpoint-25"}) in log.lines  # fmt: skip
    commit(repo, 30)  # past the spike: the event is settled, nothing moves again
    asyncio.run(loss.poll())
    assert not loss.runs["run"].pending
    assert repo.read_protections("run", now=now) == {"checkpoint-25": "loss-spike"}


# -- the callbacks and the status line -----------------------------------------------------


def test_the_hf_callback_passes_the_logged_loss_on_with_its_step(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    from transformers import TrainerControl, TrainerState

    import ckptd.trainer
    from ckptd.trainer.hf import CkptdCallback

    ckptd.trainer.install(tmp_path)  # what the callback uses: the process-wide listener
    try:
        callback = CkptdCallback()
        state = TrainerState()
        state.global_step = 7
        logs: dict[str, Any] = {"loss": 2.5, "epoch": 0.1}
        callback.on_log(None, state, TrainerControl(), logs=logs)  # type: ignore[arg-type]
        logs = {"eval_loss": 9.0}  # no training loss: nothing
        callback.on_log(None, state, TrainerControl(), logs=logs)  # type: ignore[arg-type]
    finally:
        ckptd.trainer.uninstall()
    reports, _ = read_losses(tmp_path, 0)
    assert [(r.step, r.loss) for r in reports] == [(7, 2.5)]


def test_the_lightning_callback_reads_a_loss_only_where_it_costs_no_device_sync() -> None:
    import torch

    from ckptd.trainer.lightning import _host_loss

    assert _host_loss({"loss": torch.tensor(1.5, requires_grad=True) * 1}) == 1.5
    assert _host_loss(torch.tensor([2.0])) == 2.0 and _host_loss({"loss": 3}) == 3.0
    assert _host_loss(None) is None and _host_loss(torch.zeros(3)) is None

    class OnGpu:  # what a CUDA tensor shows: its device
        device = type("device", (), {"type": "cuda"})()

        def numel(self) -> int:
            return 1

        def detach(self) -> Any:
            raise AssertionError("read off the device")

    assert _host_loss({"loss": OnGpu()}) is None


def test_ckptd_status_has_a_loss_line_with_the_spike_and_what_it_keeps() -> None:
    from ckptd.cli.statusview import loss_text

    doc = {
        "loss": {
            "run": {
                "step": 112,
                "loss": "nan",
                "volatile": True,
                "protected": ["step-60"],
                "suspect_from_step": 110,
                "events": [{"kind": "spike", "step": 70}, {"kind": "non-finite", "step": 110}],
            }
        }
    }
    (line,) = loss_text(doc)
    assert line.plain == (
        "loss: run nan at step 112  non-finite at step 110  saves from step 110 suspect"
        "  kept for a rollback: step-60"
    )
    assert loss_text({}) == []


def test_a_checkpoint_saved_after_a_nan_is_suspect_until_the_trainer_goes_back(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    from ckptd.config.health import HealthConfig

    repo = Repository(FileStorage(tmp_path / "store"))
    watch = tmp_path / "run"
    loss = LossWatch(HealthConfig(), {"run": watch}, repo, Metrics(), SYSTEM_CLOCK, Log())

    async def asked(step: int) -> str | None:
        return await loss.suspect("run", step)

    steps.report_step(39, watch, loss=1.0)
    assert asyncio.run(asked(40)) is None
    steps.report_step(40, watch, loss=float("nan"))  # not polled yet: the question reads it
    assert asyncio.run(asked(40)) == "saved after a non-finite loss at step 40"
    assert asyncio.run(asked(39)) is None and asyncio.run(loss.suspect("other", 50)) is None
    steps.report_step(20, watch, loss=1.0)  # resumed from before the NaN: a rollback
    assert asyncio.run(asked(60)) is None


# -- the cadence while the loss is volatile -------------------------------------------------


def test_the_advice_halves_while_the_loss_is_volatile_within_its_floors() -> None:
    from ckptd.cadence.model import Bounds, History, SaveRecord, advise, while_volatile
    from ckptd.cadence.model import CadencePolicy as Policy

    saves = (SaveRecord("checkpoint-1", 0.0, 30.0, 10.0, "trainer"),)  # 30 s a save
    usual = advise(History("run", saves=saves), Policy())
    short = while_volatile(usual, Bounds())
    assert short.interval_seconds == usual.interval_seconds / 2 > 60
    assert short.basis == {**usual.basis, "loss": "volatile"}
    assert short.advised.interval_seconds == short.interval_seconds
    floored = while_volatile(usual, Bounds(min_interval=usual.interval_seconds * 0.9))
    assert floored.interval_seconds == usual.interval_seconds * 0.9
    never_longer = while_volatile(usual, Bounds(min_interval=usual.interval_seconds * 2))
    assert never_longer.interval_seconds == usual.interval_seconds


def test_a_spike_shortens_the_runs_advice_until_the_loss_is_back(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    from ckptd.cadence.advisor import CadenceAdvisor
    from ckptd.config import load_settings
    from ckptd.config.health import HealthConfig

    watch = tmp_path / "run"
    settings = load_settings(
        None,
        overrides={
            "destination": {"url": f"file://{tmp_path / 'store'}"},
            "watch": [{"dir": str(watch), "run_id": "run"}],
        },
    )
    repo = Repository(FileStorage(tmp_path / "store"))
    advisor = CadenceAdvisor(settings, repo, Metrics(), {"run": watch})
    advisor.record_save("run", "checkpoint-1", 0.0, 30.0, 10.0, emergency=False)
    usual = advisor.refresh("run").interval_seconds
    assert usual > 120  # room to halve above the 60 s floor
    health = HealthConfig(loss_window=30, loss_min_reports=20)
    loss = LossWatch(health, {"run": watch}, repo, Metrics(), SYSTEM_CLOCK, Log())
    loss.on_volatile = advisor.set_volatile
    losses = noisy(100)
    for step in range(1, 26):
        steps.report_step(step, watch, loss=losses[step])
    steps.report_step(26, watch, loss=40.0)
    asyncio.run(loss.poll())
    advice = advisor.advice_json()["runs"]["run"]
    assert advice["interval_seconds"] == round(usual / 2, 3)
    assert advice["basis"]["loss"] == "volatile"
    for step in range(27, 60):
        steps.report_step(step, watch, loss=losses[step])
    asyncio.run(loss.poll())
    advice = advisor.advice_json()["runs"]["run"]
    assert advice["interval_seconds"] == round(usual, 3) and "loss" not in advice["basis"]


def test_ckptd_rm_refuses_a_rollback_target_without_force(tmp_path: Path) -> None:
    from ckptd.store.removal import RemovalRefusedError, plan_removal

    repo = Repository(FileStorage(tmp_path / "store"))
    for step in (10, 20):
        commit(repo, step)
    repo.take_lease("run", "checkpoint-10", now=0.0, until=4e9, why="loss-spike")
    with pytest.raises(RemovalRefusedError, match="kept as a rollback target"):
        plan_removal(repo, "run", "checkpoint-10", now=1000.0)
    assert plan_removal(repo, "run", "checkpoint-10", now=1000.0, force=True) is not None


def test_a_restarted_daemon_adopts_the_protection_it_took_and_releases_it_later(
    tmp_path: Path, fresh_reporter: Any
) -> None:
    from ckptd.config.health import HealthConfig
    from ckptd.repository import lease_prefix

    repo = Repository(FileStorage(tmp_path / "store"))
    watch = tmp_path / "run"
    commit(repo, 20)
    health = HealthConfig(loss_window=30, loss_min_reports=20)
    losses = noisy(100)
    for step in range(1, 26):
        steps.report_step(step, watch, loss=losses[step])
    steps.report_step(26, watch, loss=40.0)
    for _ in range(2):  # the daemon, then the same after a restart: the ring read again
        watch_ = LossWatch(health, {"run": watch}, repo, Metrics(), SYSTEM_CLOCK, Log())
        asyncio.run(watch_.poll())
        assert watch_.status()["run"]["protected"] == ["checkpoint-20"]
    assert len(list(repo.storage.list_objects(lease_prefix("run")))) == 1
    for step in range(27, 60):
        steps.report_step(step, watch, loss=losses[step])
    asyncio.run(watch_.poll())
    assert list(repo.storage.list_objects(lease_prefix("run"))) == []


def test_where_no_ring_could_be_mapped_the_steps_json_loss_is_sampled(tmp_path: Path) -> None:
    from ckptd.config.health import HealthConfig
    from ckptd.goodput.step_report import read_json_loss

    repo = Repository(FileStorage(tmp_path / "store"))
    watch = tmp_path / "run"
    report = steps._JsonReport(watch / steps.STEPS_RELPATH, 1, 0.0)
    report.every = 0
    loss = LossWatch(HealthConfig(), {"run": watch}, repo, Metrics(), SYSTEM_CLOCK, Log())
    report.write(7, 1.5, 0.25)
    asyncio.run(loss.poll())
    asyncio.run(loss.poll())  # the same sample: not judged twice
    assert loss.runs["run"].tracker.reports == 1 and loss.status()["run"]["loss"] == 0.25
    report.write(8, 2.5, float("inf"))
    sample = read_json_loss(watch)
    assert sample is not None and (sample.step, sample.loss) == (8, float("inf"))
    assert asyncio.run(loss.suspect("run", 8)) == "saved after a non-finite loss at step 8"
    report.write(9, 3.5)  # a report without a loss
    assert read_json_loss(watch) is None


def test_ckptd_status_says_the_cadence_is_halved_while_the_loss_is_volatile() -> None:
    from ckptd.cli.statusview import advice_text

    advice = {"interval_seconds": 600, "save_seconds": 30, "mtbf_seconds": 86400}
    calm = {"basis": {"save": "trainer", "mtbf": "prior"}, **advice}
    volatile = {"basis": {"save": "trainer", "mtbf": "prior", "loss": "volatile"}, **advice}
    (line,) = advice_text({"advice": {"run": volatile}})
    assert "halved: loss volatile" in line.plain
    (line,) = advice_text({"advice": {"run": calm}})
    assert "halved" not in line.plain
