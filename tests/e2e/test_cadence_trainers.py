"""Following the advice in a real PyTorch Lightning run (in process, on CPU, a clock
that advances one second per batch), and the ``ckptd status`` line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ckptd.cli.statusview import advice_text
from ckptd.trainer.cadence import AdvisedCadence
from ckptd.trainer.listener import PreemptionListener

pl = pytest.importorskip("lightning.pytorch")
torch = pytest.importorskip("torch")


class Tiny(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(256, 4), batch_size=4)


class Clock(pl.Callback):  # type: ignore[misc]
    """One second per batch; at batch ``change_at`` the daemon's advice changes."""

    def __init__(self, advice: Path, change_at: int, new_interval: float) -> None:
        self.now = 0.0
        self.advice, self.change_at, self.new_interval = advice, change_at, new_interval

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.now += 1.0
        if trainer.global_step == self.change_at:
            self.advice.write_text(json.dumps({"interval_seconds": self.new_interval}))


def test_lightning_saves_on_the_advised_interval_and_follows_a_new_one(tmp_path: Path) -> None:
    from ckptd.trainer.lightning import CkptdLightningCallback

    advice = tmp_path / ".ckptd" / "advice.json"
    advice.parent.mkdir()
    advice.write_text(json.dumps({"interval_seconds": 10.0}))
    clock = Clock(advice, change_at=20, new_interval=4.0)
    cadence = AdvisedCadence(tmp_path, refresh_seconds=0.0, clock=clock)
    listener = PreemptionListener(tmp_path / "no-notices", url="")
    try:
        callback = CkptdLightningCallback(
            tmp_path, listener=listener, follow_advice=True, cadence=cadence
        )
        trainer = pl.Trainer(
            max_steps=33,
            callbacks=[clock, callback],
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            accelerator="cpu",
        )
        trainer.fit(Tiny())
    finally:
        listener.close()
    # Every 10 batches, then every 4 from the save at step 20 (the new advice is read).
    assert [p.name for p in callback.advised_saves] == [
        f"step={s}.ckpt" for s in (10, 20, 24, 28, 32)
    ]
    assert all(p.is_file() for p in callback.advised_saves)
    reports = [
        json.loads(line) for line in (tmp_path / ".ckptd" / "saves.jsonl").read_text().splitlines()
    ]
    assert [r["checkpoint"] for r in reports] == [p.name for p in callback.advised_saves]
    assert [r["step"] for r in reports] == [10, 20, 24, 28, 32]


def test_status_shows_the_advice_and_the_cost_of_the_current_cadence() -> None:
    doc = {
        "advice": {
            "run1": {
                "interval_seconds": 3180.0,
                "save_seconds": 60.0,
                "mtbf_seconds": 86400.0,
                "basis": {"save": "trainer", "mtbf": "measured"},
                "expected_cost": {
                    "advised": {"total_fraction": 0.0387},
                    "current": {"interval_seconds": 600.0, "total_fraction": 0.0961},
                },
            }
        }
    }
    console = Console(width=200, record=True)
    for line in advice_text(doc):
        console.print(line)
    text = console.export_text()
    assert "run1 save every 53m00s" in text
    assert "save 60.0s trainer" in text and "MTBF 24h00m measured" in text
    assert "lost 3.9% vs 9.6% now (every 10m00s)" in text
    assert "store history" not in text
    assert advice_text({}) == []
    # Advice from the prior alone because the store could not be read says so.
    doc["advice"]["run1"]["history"] = "unreadable"
    console = Console(width=200, record=True)
    for line in advice_text(doc):
        console.print(line)
    assert "store history unreadable" in console.export_text()
