"""Hugging Face ``Trainer`` callback: on a preemption notice, save a checkpoint and stop
(on a health ``save``, which asks for a save only, save and train on).

::

    from ckptd.trainer.hf import CkptdCallback

    trainer = Trainer(..., callbacks=[CkptdCallback()])

The Trainer writes the checkpoint itself (``<output_dir>/checkpoint-<step>/``, with
``trainer_state.json`` last), which is the layout the daemon ships as ``hf``.

``CkptdCallback(follow_advice=True)`` also saves on the daemon's advised interval
(``ckptd.trainer.cadence``), beside or instead of ``save_steps``; either way the callback
reports each save's blocking time to the daemon, which is what the advice is made of.

The training loss the Trainer logs (every ``logging_steps``, already a Python float: the
Trainer took it off the device for its log) goes to the daemon with the step
(``report_step(step, loss=...)``, docs/health.md "The training's own health"); no step
waits for the device for it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import ckptd.trainer
from ckptd.trainer.agree import agree_any
from ckptd.trainer.cadence import AdvisedCadence
from ckptd.trainer.listener import PreemptionListener
from ckptd.trainer.resumed import report_resumed
from ckptd.trainer.steps import report_step

__all__ = ["CkptdCallback"]

log = logging.getLogger("ckptd.trainer")


class CkptdCallback(TrainerCallback):
    """Saves a checkpoint at the end of the current step and stops training on a notice.

    The process-wide listener (:func:`ckptd.trainer.get_listener`) is installed when the
    callback is built, so build it at start-up, in the main thread. Its notice file is
    looked for under ``watch_dir``, else ``CKPTD_WATCH_DIR``, else ``args.output_dir``.

    In multi-process training (``torch.distributed`` initialised) the ranks agree on the
    step: each step's decision is one all-reduce of every rank's own flags, on the CPU
    (:func:`ckptd.trainer.agree.agree_any`), so a notice that one rank sees makes every
    rank save that same step, and the collective save meets.

    ``follow_advice=True`` saves whenever the daemon's advised interval of training has
    passed since the last save ended (any save: ``save_steps``' too), re-reading the
    advice as it changes; the ranks agree on that step in the same all-reduce.
    """

    def __init__(
        self,
        watch_dir: str | os.PathLike[str] | None = None,
        *,
        listener: PreemptionListener | None = None,
        follow_advice: bool = False,
        cadence: AdvisedCadence | None = None,
    ) -> None:
        self.listener = listener if listener is not None else ckptd.trainer.get_listener(watch_dir)
        if watch_dir is not None and listener is not None:
            self.listener.watch_dir = watch_dir
        self.fired_at_step: int | None = None  # the step it saved at and stopped
        self.save_only_steps: list[int] = []  # the steps saved at for a health save
        self.follow_advice = follow_advice
        self.cadence = cadence if cadence is not None else AdvisedCadence(watch_dir)
        self.advised_saves: list[int] = []  # steps saved on the advice
        self._step_end = time.monotonic()

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Watch ``args.output_dir`` when no watch dir was configured, and report what the
        trainer resumed from: the Trainer has loaded it by now, and names its checkpoints
        ``checkpoint-<global step>`` (step 0: from scratch)."""
        if self.listener.watch_dir is None and args.output_dir:
            self.listener.watch_dir = args.output_dir
        if self.cadence.watch_dir is None and args.output_dir:
            self.cadence.watch_dir = args.output_dir
        self.cadence.reset()
        where = self.listener.watch_dir
        if where is not None and state.is_world_process_zero:
            report_resumed(
                f"checkpoint-{state.global_step}" if state.global_step else None, watch_dir=where
            )

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Pass the logged training loss on with its step (a float the Trainer made)."""
        loss = (logs or {}).get("loss")
        if isinstance(loss, float | int) and not isinstance(loss, bool):
            report_step(state.global_step, loss=float(loss))

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Ask the Trainer to save now and stop, once, when a notice has arrived; to save
        only when the notice asks for a save only (a health ``save``)."""
        # Only at step end, not on_substep_end: mid gradient-accumulation there is no
        # consistent state to save, and the Trainer saves only at step boundaries anyway.
        # The Trainer saves right after this hook: its save time is counted from here.
        self._step_end = time.monotonic()
        report_step(state.global_step)  # for ckptd exec's goodput (cheap: see steps.py)
        if self.fired_at_step is not None:
            return
        # Every rank runs this at every step: the all-reduce inside is a collective, one
        # per step for its flags (the notice, the advised interval, stop or train on).
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
                control.should_save = True
                self.advised_saves.append(state.global_step)
            return
        control.should_save = True
        log.warning(
            "ckptd: preemption notice %s; saving checkpoint-%d and %s",
            self.listener.notice() or "(by signal)",
            state.global_step,
            "stopping" if stop else "training on",
        )
        if not stop:
            # The Trainer saves right after this hook: the notice is answered, and the
            # next one is heard again.
            self.listener.saved()
            self.save_only_steps.append(state.global_step)
            return
        self.fired_at_step = state.global_step
        control.should_training_stop = True

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Report the save's blocking time; the advised interval restarts from here."""
        self.cadence.started(at=self._step_end)
        seconds = self.cadence.finished(
            checkpoint=f"checkpoint-{state.global_step}", step=state.global_step
        )
        log.debug("ckptd: checkpoint-%d saved in %.3f s", state.global_step, seconds)
