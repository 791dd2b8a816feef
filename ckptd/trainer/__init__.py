"""In-process helpers for trainers: save a checkpoint now when the node is being preempted.

A plain training loop::

    import ckptd.trainer

    ckptd.trainer.install("/data/ckpt/run1")   # at start-up, before the daemon may signal
    for step, batch in enumerate(loader):
        train_step(batch)
        if ckptd.trainer.preempted():
            save_checkpoint(f"/data/ckpt/run1/step-{step}")
            ckptd.trainer.report_save("/data/ckpt/run1", checkpoint=f"step-{step}")
            if ckptd.trainer.stop_requested():
                break

:func:`report_save` is optional: it tells the daemon the save has returned, so the
checkpoint is taken as complete at once instead of after its layout's quiet window.
:func:`stop_requested` tells a notice that ends the node (a cloud's, SIGTERM: save, then
stop) from a health ``save`` (docs/health.md), which asks for a save only: for that one it
is False, and the save being reported (:func:`report_save`) or the question asked after it
is the end of that notice: :func:`preempted` is False again until the next. A loop that
breaks on :func:`preempted` alone stops on a health save too, as it always did.
:func:`report_resumed`, once at start-up, says which checkpoint the trainer loaded (None:
none): a trainer that rolls back to an older checkpoint starts a new trajectory, whose
saves commit and which ``restore --latest`` then follows (``ckptd.trainer.resumed``).

With several ranks (``torch.distributed``) every rank must save the *same* step: call
:func:`preempted_on_any_rank` on every rank at every step instead of :func:`preempted`
(an all-reduce of the ranks' flags on the CPU, never a GPU sync, see
``ckptd.trainer.agree``)::

    if ckptd.trainer.preempted_on_any_rank():   # True on all ranks at the same step
        save_checkpoint(step)                    # a collective save meets
        if ckptd.trainer.stop_requested_on_any_rank():
            break

Call :func:`install` (or build a callback) early: until a handler is installed, the
daemon's signal (SIGUSR1 by default) kills the process, as it does any program that does
not expect it. :func:`preempted` alone installs lazily, on its first call.

Framework callbacks live in their own modules so that this package imports without them:
``ckptd.trainer.hf.CkptdCallback`` (Hugging Face ``Trainer``) and
``ckptd.trainer.lightning.CkptdLightningCallback`` (PyTorch Lightning); both names are also
reachable here, imported on first use.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.trainer.agree import agree_any, agree_to_save
from ckptd.trainer.cadence import report_save as _report_save
from ckptd.trainer.listener import (
    DEFAULT_SIGNAL,
    DEFAULT_URL,
    NOTICE_RELPATH,
    PreemptionListener,
    notice_path,
    parse_notice,
    parse_signal,
    save_only,
)
from ckptd.trainer.resumed import report_resumed
from ckptd.trainer.steps import report_step

if TYPE_CHECKING:
    from ckptd.trainer.hf import CkptdCallback
    from ckptd.trainer.lightning import CkptdLightningCallback

__all__ = [
    "DEFAULT_SIGNAL",
    "DEFAULT_URL",
    "NOTICE_RELPATH",
    "CkptdCallback",
    "CkptdLightningCallback",
    "PreemptionListener",
    "agree_any",
    "agree_to_save",
    "get_listener",
    "install",
    "notice",
    "notice_path",
    "parse_notice",
    "parse_signal",
    "preempted",
    "preempted_on_any_rank",
    "report_resumed",
    "report_save",
    "report_step",
    "resume_from",
    "save_only",
    "stop_requested",
    "stop_requested_on_any_rank",
    "uninstall",
]

_lock = threading.Lock()
_listener: PreemptionListener | None = None
# The watch_dir argument preempted() last applied, compared as given (str or path) per call.
_last_watch_dir: str | os.PathLike[str] | None = None


def install(
    watch_dir: str | os.PathLike[str] | None = None,
    *,
    signum: int | str | None = None,
    url: str | None = None,
    token: str | None = None,
    file_poll_interval: float = 0.5,
    http_poll_interval: float = 1.0,
) -> PreemptionListener:
    """Create the process-wide listener, replacing any earlier one; call it at start-up.

    Arguments left as None come from ``CKPTD_WATCH_DIR``, ``CKPTD_SIGNAL``, ``CKPTD_URL``
    and ``CKPTD_TOKEN`` (see :class:`PreemptionListener`). Call from the main thread.
    """
    global _listener, _last_watch_dir
    with _lock:
        if _listener is not None:
            _listener.close()
        _last_watch_dir = None
        _listener = PreemptionListener(
            watch_dir,
            signum=signum,
            url=url,
            token=token,
            file_poll_interval=file_poll_interval,
            http_poll_interval=http_poll_interval,
        )
        return _listener


def get_listener(watch_dir: str | os.PathLike[str] | None = None) -> PreemptionListener:
    """Return the process-wide listener, installing it with defaults if there is none.

    ``watch_dir``, when given, becomes the dir whose notice file is watched.
    """
    global _listener, _last_watch_dir
    with _lock:
        if _listener is None:
            _listener = PreemptionListener(watch_dir)
        elif watch_dir is not None and _listener.watch_dir != Path(watch_dir):
            _listener.watch_dir = watch_dir
            _last_watch_dir = None
        return _listener


def preempted(watch_dir: str | os.PathLike[str] | None = None) -> bool:
    """Return True once the daemon has announced a preemption; cheap enough for every step."""
    global _last_watch_dir
    current = _listener
    # Fast path without the lock or a Path(): the common call passes the same dir every step.
    if current is not None and (watch_dir is None or watch_dir == _last_watch_dir):
        return current.preempted()
    current = get_listener(watch_dir)
    _last_watch_dir = watch_dir
    return current.preempted()


def preempted_on_any_rank(group: Any = None) -> bool:
    """:func:`preempted` agreed over the trainer's process group (default: every rank):
    True on every rank at the first step where any rank has the notice. A collective:
    call it on every rank at every step. Without ``torch.distributed`` it is
    :func:`preempted`."""
    return agree_to_save(preempted(), group)


def stop_requested() -> bool:
    """After :func:`preempted` turned True: whether to stop once saved (every notice but
    a health ``save``, see :meth:`PreemptionListener.stop_requested`). For a save-only
    notice it is False and marks the notice saved for (:func:`preempted` turns False)."""
    current = _listener
    if current is None:
        return False
    stop = current.stop_requested()
    if not stop:
        current.saved()
    return stop


def stop_requested_on_any_rank(group: Any = None) -> bool:
    """:func:`stop_requested` agreed over the trainer's process group: every rank stops,
    or every rank trains on. A collective: call it on every rank where they saved."""
    return agree_to_save(stop_requested(), group)


def report_save(
    watch_dir: str | os.PathLike[str],
    *,
    checkpoint: str | None = None,
    step: int | None = None,
    seconds: float | None = None,
) -> None:
    """Tell the daemon this process's part of a save is written
    (:func:`ckptd.trainer.cadence.report_save`); a save-only notice is then done with
    (:meth:`PreemptionListener.saved`). Never raises."""
    _report_save(watch_dir, checkpoint=checkpoint, step=step, seconds=seconds)
    current = _listener
    if current is not None:
        current.saved()


def notice() -> dict[str, Any] | None:
    """Return the current notice's JSON, or None (see :meth:`PreemptionListener.notice`)."""
    current = _listener
    return current.notice() if current is not None else None


def resume_from() -> Path | None:
    """The checkpoint ``ckptd exec`` says to resume from (``CKPTD_RESUME_FROM``), or None
    when there is none (a fresh run, or not under ``ckptd exec``)::

        trainer.train(resume_from_checkpoint=ckptd.trainer.resume_from())   # HF Trainer
        trainer.fit(model, ckpt_path=ckptd.trainer.resume_from())           # Lightning
    """
    value = os.environ.get("CKPTD_RESUME_FROM", "")
    return Path(value) if value else None


def uninstall() -> None:
    """Close the process-wide listener and put the previous signal handler back."""
    global _listener, _last_watch_dir
    with _lock:
        if _listener is not None:
            _listener.close()
            _listener = None
        _last_watch_dir = None


def __getattr__(name: str) -> Any:
    # The callbacks import transformers / lightning, so load them only when asked for.
    if name == "CkptdCallback":
        from ckptd.trainer.hf import CkptdCallback

        return CkptdCallback
    if name == "CkptdLightningCallback":
        from ckptd.trainer.lightning import CkptdLightningCallback

        return CkptdLightningCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
