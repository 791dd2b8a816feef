"""PyTorch Lightning callback: on a preemption notice, save a checkpoint now and stop
(on a health ``save``, which asks for a save only, save and train on).

::

    from ckptd.trainer.lightning import CkptdLightningCallback

    trainer = L.Trainer(..., callbacks=[CkptdLightningCallback()])

The checkpoint is ``preempt-step=<global_step>.ckpt`` in the ``ModelCheckpoint`` dirpath
(else ``trainer.default_root_dir``), written by ``trainer.save_checkpoint``, which saves
through an fsspec transaction (temporary file, then rename): the daemon never sees half.

Each batch's loss (``training_step``'s ``loss``) goes to the daemon with the step
(``report_step(step, loss=...)``, docs/health.md) when it is a Python number or a tensor
in host memory: one on a GPU is left there, as reading it would wait for the device.

Built on ``lightning.pytorch`` when installed, else ``pytorch_lightning``; Lightning calls
callbacks by hook name, so the one class serves a Trainer of either package.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ckptd.trainer
from ckptd.trainer.agree import agree_any
from ckptd.trainer.cadence import AdvisedCadence, report_save
from ckptd.trainer.listener import PreemptionListener
from ckptd.trainer.resumed import report_resumed
from ckptd.trainer.steps import report_step

if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer
else:
    try:
        from lightning.pytorch import Callback, LightningModule, Trainer
    except ImportError:
        from pytorch_lightning import Callback, LightningModule, Trainer

__all__ = ["CkptdLightningCallback"]

log = logging.getLogger("ckptd.trainer")


class CkptdLightningCallback(Callback):
    """Saves ``preempt-step=<step>.ckpt`` after the current batch and stops, on a notice.

    The process-wide listener (:func:`ckptd.trainer.get_listener`) is installed when the
    callback is built, before ``Trainer.fit`` registers Lightning's own signal handlers.
    Lightning installs its SLURM auto-requeue handler on SIGUSR1 only when no handler is
    there, so ckptd's wins; a warning says so when that requeue was wanted.

    ``dirpath`` overrides where the checkpoint goes; the notice file is looked for under
    ``watch_dir``, else ``CKPTD_WATCH_DIR``, else that checkpoint dir. As with any
    ``save_checkpoint``, every rank must take the decision at the same batch: each
    batch's decision is one all-reduce of every rank's own flags (notice, advised
    interval) over the default process group's ranks, on the CPU
    (:func:`ckptd.trainer.agree.agree_any`), so one rank's notice is every rank's.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        watch_dir: str | os.PathLike[str] | None = None,
        listener: PreemptionListener | None = None,
        filename: str = "preempt-step={step}.ckpt",
        follow_advice: bool = False,
        cadence: AdvisedCadence | None = None,
        advised_filename: str = "step={step}.ckpt",
    ) -> None:
        super().__init__()
        self.listener = listener if listener is not None else ckptd.trainer.get_listener(watch_dir)
        if watch_dir is not None and listener is not None:
            self.listener.watch_dir = watch_dir
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename
        self.saved_path: Path | None = None  # the checkpoint it stopped on
        self.save_only_saves: list[Path] = []  # those it trained on after (a health save)
        # follow_advice: also save ``advised_filename`` on the daemon's advised interval.
        self.follow_advice = follow_advice
        self.cadence = cadence if cadence is not None else AdvisedCadence(watch_dir)
        self.advised_filename = advised_filename
        self.advised_saves: list[Path] = []

    def checkpoint_dir(self, trainer: Trainer) -> Path:
        """Where the preemption checkpoint goes: ``dirpath``, ModelCheckpoint's, or the root."""
        if self.dirpath is not None:
            return self.dirpath
        checkpoint_callback = trainer.checkpoint_callback
        dirpath = getattr(checkpoint_callback, "dirpath", None)
        return Path(dirpath) if dirpath else Path(trainer.default_root_dir)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Settle the watch dir (ModelCheckpoint resolves its dirpath during setup)."""
        if self.listener.watch_dir is None:
            self.listener.watch_dir = self.checkpoint_dir(trainer)
        if self.cadence.watch_dir is None:
            self.cadence.watch_dir = self.checkpoint_dir(trainer)
        self.cadence.reset()
        self._warn_if_slurm_requeue_displaced(trainer)
        if trainer.is_global_zero and self.listener.watch_dir is not None:
            # What the trainer loaded (None: from scratch), for the daemon's trajectory.
            report_resumed(trainer.ckpt_path, watch_dir=self.listener.watch_dir)

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Save now and ask the trainer to stop, once, when a notice has arrived; train
        on after the save when the notice asks for a save only (a health ``save``)."""
        # For ckptd exec's goodput and the loss-spike rule (cheap: see steps.py).
        report_step(trainer.global_step, loss=_host_loss(outputs))
        if self.saved_path is not None:
            return
        # Every rank runs this at every batch: the all-reduce inside is a collective, one
        # per batch for its flags (the notice, the advised interval, stop or train on).
        preempted = self.listener.preempted()
        # The third flag is read only where a notice is: a health save asks for a save
        # only, and every rank trains on unless a rank's notice asks to stop.
        notice, due, stop = agree_any(
            preempted,
            self.follow_advice and self.cadence.due(),
            preempted and self.listener.stop_requested(),
        )
        if not notice:
            if due:
                self._save_on_advice(trainer)
            return
        path = self.checkpoint_dir(trainer) / self.filename.format(step=trainer.global_step)
        log.warning(
            "ckptd: preemption notice %s; saving %s",
            self.listener.notice() or "(by signal)",
            path,
        )
        trainer.save_checkpoint(path)  # returns on every rank after a barrier
        # The daemon takes it as complete now, not after its quiet window (ckptd.core.saves).
        report_save(path.parent, checkpoint=path.name, step=trainer.global_step)
        if not stop:
            self.listener.saved()  # the next notice is heard again
            self.save_only_saves.append(path)
            log.warning("ckptd: saved %s for a save-only notice; training on", path)
            return
        self.saved_path = path
        trainer.should_stop = True

    def _save_on_advice(self, trainer: Trainer) -> None:
        """Save now: the advised interval has passed (``save_checkpoint`` blocks, so the
        next save can only start after this one is written)."""
        path = self.checkpoint_dir(trainer) / self.advised_filename.format(step=trainer.global_step)
        with self.cadence.saving(path.name, trainer.global_step):
            trainer.save_checkpoint(path)
        self.advised_saves.append(path)

    def _warn_if_slurm_requeue_displaced(self, trainer: Trainer) -> None:
        # Single-device strategies do not expose the cluster environment; the connector does.
        environment = getattr(trainer.strategy, "cluster_environment", None) or getattr(
            getattr(trainer, "_accelerator_connector", None), "cluster_environment", None
        )
        if not getattr(environment, "auto_requeue", False):
            return
        requeue_signal = getattr(environment, "requeue_signal", None)
        if requeue_signal is not None and requeue_signal == self.listener.signum:
            log.warning(
                "ckptd: %s now means 'save and stop'; Lightning's SLURM auto-requeue on it "
                "is off. Set CKPTD_SIGNAL (and the daemon's trainer.signal) to another signal "
                "to keep both.",
                signal.Signals(requeue_signal).name,
            )


def _host_loss(outputs: Any) -> float | None:
    """The batch's loss when reading it costs no device sync: a number, or a one-element
    tensor in host memory; None otherwise (a GPU tensor, no loss)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, float | int) and not isinstance(loss, bool):
        return float(loss)
    device = getattr(loss, "device", None)
    if getattr(device, "type", None) == "cpu" and getattr(loss, "numel", lambda: 0)() == 1:
        return float(loss.detach())  # type: ignore[union-attr]
    return None
