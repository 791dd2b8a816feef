"""Hugging Face ``Trainer`` callback: on a preemption notice, save a checkpoint and stop.

::

    from ckptd.trainer.hf import CkptdCallback

    trainer = Trainer(..., callbacks=[CkptdCallback()])

The Trainer writes the checkpoint itself (``<output_dir>/checkpoint-<step>/``, with
``trainer_state.json`` last), which is the layout the daemon ships as ``hf``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import ckptd.trainer
from ckptd.trainer.agree import agree_to_save
from ckptd.trainer.listener import PreemptionListener

__all__ = ["CkptdCallback"]

log = logging.getLogger("ckptd.trainer")


class CkptdCallback(TrainerCallback):
    """Saves a checkpoint at the end of the current step and stops training on a notice.

    The process-wide listener (:func:`ckptd.trainer.get_listener`) is installed when the
    callback is built, so build it at start-up, in the main thread. Its notice file is
    looked for under ``watch_dir``, else ``CKPTD_WATCH_DIR``, else ``args.output_dir``.

    In multi-process training (``torch.distributed`` initialised) the ranks agree on the
    step: each step's decision is an all-reduce of every rank's own flag
    (:func:`ckptd.trainer.agree_to_save`), so a notice that one rank sees makes every
    rank save that same step, and the collective save meets.
    """

    def __init__(
        self,
        watch_dir: str | os.PathLike[str] | None = None,
        *,
        listener: PreemptionListener | None = None,
    ) -> None:
        self.listener = listener if listener is not None else ckptd.trainer.get_listener(watch_dir)
        if watch_dir is not None and listener is not None:
            self.listener.watch_dir = watch_dir
        self.fired_at_step: int | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Watch ``args.output_dir`` when no watch dir was configured."""
        if self.listener.watch_dir is None and args.output_dir:
            self.listener.watch_dir = args.output_dir

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Ask the Trainer to save now and stop, once, when a notice has arrived."""
        # Only at step end, not on_substep_end: mid gradient-accumulation there is no
        # consistent state to save, and the Trainer saves only at step boundaries anyway.
        if self.fired_at_step is not None:
            return
        # Every rank runs this at every step: the all-reduce inside is a collective.
        if not agree_to_save(self.listener.preempted()):
            return
        self.fired_at_step = state.global_step
        log.warning(
            "ckptd: preemption notice %s; saving checkpoint-%d and stopping",
            self.listener.notice() or "(by signal)",
            state.global_step,
        )
        control.should_save = True
        control.should_training_stop = True
