"""The drill's second half, what a fresh node does with the run's checkpoint: restore it
into a scratch dir, verify every byte on disk, and have the trainer's own code load it
(``[drill] check``), each stage timed.

It runs in the daemon after a drill's commit (in a thread), and by itself on any node
that reaches the store (``ckptd drill --restore-only``).

    restored  the checkpoint read from the store: resolved, every object fetched (the
              restore's own checks run as it writes: ``ckptd.store.restore``)
    verified  every byte matches the manifest: what the restore refused as it wrote (an
              object missing, of another size or content, a signature that fails), then
              each file re-read from disk (its pages dropped first, so the disk answers,
              not the page cache) against the manifest's size and CRC-32C
    loaded    ``check`` exits 0 within ``check_timeout``, run with the restored path as
              its last argument and in ``CKPTD_RESUME_FROM`` (``CKPTD_RUN``: the run);
              on the timeout its whole process group is killed
    resumed   (only when asked: ``resume_steps`` > 0) the trainer's own command started
              from the restored checkpoint (``CKPTD_RESUME_FROM``, ``CKPTD_RUN``,
              ``CKPTD_WATCH_DIR`` the drill's scratch dir, ``CKPTD_DRILL_RESUME_STEPS``)
              reports ``resume_steps`` steps (``ckptd.trainer.report_step``, counted from
              its first report) within ``resume_timeout``; then it has ``STOP_GRACE_SECONDS``
              to exit by itself before its process group is sent SIGTERM, and as long again
              before SIGKILL. Exiting before its steps, or the timeout, fails the stage

Invariants: nothing is written outside the drill's own scratch dir, and that directory is
removed before ``prove`` returns, whatever happened; a stage passes only on what it
checked.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptd.core import checksum
from ckptd.core.manifest import Manifest, ManifestError
from ckptd.core.signing import AuthenticationError, KeyRing
from ckptd.drill.model import RESTORE_STAGES, RESUME_STAGE, StageResult, not_reached
from ckptd.goodput.step_report import read_steps
from ckptd.repository import FileProblem, Repository
from ckptd.runtime.file_checksum import file_crc32c
from ckptd.runtime.logs import get_logger
from ckptd.storage.base import Storage, StorageError
from ckptd.store.restore import (
    RestoreError,
    RestoreRequest,
    is_single_file,
    local_problems,
    restore,
)

# A resumed trainer that reached its steps exits by itself within this, else is stopped.
STOP_GRACE_SECONDS = 10.0
# How often the resumed trainer's step report is read.
RESUME_POLL_SECONDS = 0.2
# What of a failed check's output the record keeps: its last line, this long at most.
OUTPUT_TAIL_CHARS = 300
# A drill's scratch dir is named by its id: ``20261206T135100.123Z.<writer>``.
_DRILL_DIR = re.compile(r"\d{8}T\d{6}\.\d{3}Z\..+")
Monotonic = Callable[[], float]


@dataclass(frozen=True)
class ProofRequest:
    """Restore ``checkpoint`` (None: the newest committed) of ``run_id`` into ``scratch``
    (the drill's own directory), verify it, and run ``check`` on it."""

    run_id: str
    checkpoint: str | None
    scratch: Path
    check: Sequence[str]
    check_timeout: float
    concurrency: int = 8
    keys: KeyRing | None = None
    resume: Sequence[str] = ()
    resume_steps: int = 0
    resume_timeout: float = 1800.0

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages this proof runs, in order."""
        return (*RESTORE_STAGES, RESUME_STAGE) if self.resume_steps > 0 else RESTORE_STAGES


@dataclass(frozen=True)
class Proof:
    """The three stages, the checkpoint restored and its size, and the failed stage's
    one line (empty when none failed)."""

    stages: list[StageResult]
    checkpoint: str | None
    bytes: int
    error: str


def prove(
    storage: Storage, request: ProofRequest, *, monotonic: Monotonic = time.monotonic
) -> Proof:
    """The three stages of the module doc, in order; the scratch dir removed after."""
    log = get_logger(run=request.run_id)
    try:
        return _prove(storage, request, monotonic)
    finally:
        try:
            shutil.rmtree(request.scratch)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("drill_scratch_not_removed", path=str(request.scratch), error=str(exc))


def _prove(storage: Storage, request: ProofRequest, monotonic: Monotonic) -> Proof:
    restored, verified = RESTORE_STAGES[:2]
    started = monotonic()
    try:
        result = restore(
            storage,
            RestoreRequest(
                request.run_id,
                request.checkpoint,
                request.scratch,
                concurrency=request.concurrency,
                progress=False,
                keys=request.keys,
            ),
        )
    except (RestoreError, AuthenticationError) as exc:
        problems = exc.problems if isinstance(exc, RestoreError) else []
        if isinstance(exc, RestoreError) and not problems:  # the target: I/O, free space
            return _failed(restored, monotonic() - started, str(exc), request.stages[1:])
        # The store's copy disagrees with its manifest: read, and refused as written.
        error = (
            f"{len(problems)} object(s) in the store do not match the manifest{_listed(problems)}"
            if problems
            else str(exc)
        )
        return Proof(
            [
                StageResult(restored, "ok", monotonic() - started, "stopped by the check below"),
                StageResult(verified, "failed", 0.0, error),
                *not_reached(request.stages[2:]),
            ],
            request.checkpoint,
            0,
            error,
        )
    except (StorageError, ManifestError) as exc:
        return _failed(restored, monotonic() - started, str(exc), request.stages[1:])
    stages = [
        StageResult(
            restored,
            "ok",
            monotonic() - started,
            f"{result.checkpoint}: {result.files} files, {result.total_bytes} bytes",
        )
    ]
    begun = monotonic()
    try:
        manifest = Repository(storage).resolve(request.run_id, result.checkpoint)
        problems = disk_problems(result.path, manifest)
    except (StorageError, ManifestError, OSError) as exc:
        problems = [FileProblem("", f"cannot re-read: {exc}")]
    if problems:
        error = f"{len(problems)} restored file(s) differ from the manifest{_listed(problems)}"
        stages += [StageResult(verified, "failed", monotonic() - begun, error)]
        return Proof([*stages, *not_reached(request.stages[2:])], result.checkpoint, 0, error)
    stages.append(
        StageResult(verified, "ok", monotonic() - begun, "every byte re-read matches the manifest")
    )
    stages.append(_load(request, result.path, monotonic))
    if request.resume_steps > 0:
        if stages[-1].status == "failed":
            stages += not_reached([RESUME_STAGE])
        else:
            stages.append(_resume(request, result.path, monotonic))
    error = next((s.detail for s in stages if s.status == "failed"), "")
    return Proof(stages, result.checkpoint, result.total_bytes, error)


def _failed(stage: str, seconds: float, error: str, after: Sequence[str]) -> Proof:
    return Proof(
        [StageResult(stage, "failed", seconds, error), *not_reached(after)], None, 0, error
    )


def _listed(problems: Sequence[FileProblem], most: int = 3) -> str:
    if not problems:
        return ""
    shown = "; ".join(f"{p.path or '(checkpoint)'}: {p.problem}" for p in problems[:most])
    more = f"; and {len(problems) - most} more" if len(problems) > most else ""
    return f": {shown}{more}"


def disk_problems(path: Path, manifest: Manifest) -> list[FileProblem]:
    """How the restored ``path`` differs from ``manifest``: each file's type and size,
    then every byte re-read from disk (its cached pages dropped first) and CRC-32C'd."""
    problems = local_problems(path, manifest)
    wrong = {p.path for p in problems}
    single = is_single_file(manifest)
    for f in manifest.files:
        if f.path in wrong:
            continue
        crc = file_crc32c(path if single else path / f.path, from_disk=True)
        if checksum.to_hex(crc) != f.crc32c:
            problems.append(
                FileProblem(
                    f.path, f"crc32c {checksum.to_hex(crc)} on disk, manifest says {f.crc32c}"
                )
            )
    return problems


def _load(request: ProofRequest, path: Path, monotonic: Monotonic) -> StageResult:
    """Run the load check on ``path`` (module doc, "loaded")."""
    name = RESTORE_STAGES[2]
    if not request.check:
        return StageResult(name, "skipped", None, "not checked: no [drill] check configured")
    argv = [*request.check, str(path)]
    env = {**os.environ, "CKPTD_RESUME_FROM": str(path), "CKPTD_RUN": request.run_id}
    begun = monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: a timeout ends all it started
        )
    except OSError as exc:
        return StageResult(
            name, "failed", monotonic() - begun, f"cannot run the load check {argv[0]!r}: {exc}"
        )
    try:
        output, _ = proc.communicate(timeout=request.check_timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return StageResult(
            name,
            "failed",
            monotonic() - begun,
            f"the load check did not finish within {request.check_timeout:g} s: killed"
            + _tail(output),
        )
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind in its group
    seconds = monotonic() - begun
    if proc.returncode != 0:
        return StageResult(
            name, "failed", seconds, f"the load check exited {proc.returncode}" + _tail(output)
        )
    return StageResult(name, "ok", seconds, f"the load check ({Path(argv[0]).name}) exited 0")


def _resume(request: ProofRequest, path: Path, monotonic: Monotonic) -> StageResult:
    """Start the trainer from ``path`` and wait for its steps (module doc, "resumed")."""
    steps = request.resume_steps
    if not request.resume:
        return StageResult(RESUME_STAGE, "failed", None, "no command to resume the trainer with")
    argv = list(request.resume)
    env = {
        **os.environ,
        "CKPTD_RESUME_FROM": str(path),
        "CKPTD_RUN": request.run_id,
        "CKPTD_WATCH_DIR": str(request.scratch),
        "CKPTD_DRILL_RESUME_STEPS": str(steps),
    }
    begun = monotonic()
    with tempfile.TemporaryFile() as output:
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            return StageResult(
                RESUME_STAGE, "failed", None, f"cannot start the trainer {argv[0]!r}: {exc}"
            )
        try:
            done, code = _await_steps(proc, request, monotonic, begun)
            if done < steps:
                seconds = monotonic() - begun
                if code is None:
                    why = f"killed after {request.resume_timeout:g} s"
                else:
                    why = f"the trainer exited {code}"
                output.seek(0)
                detail = f"{done} of {steps} steps: {why}" + _tail(output.read())
                return StageResult(RESUME_STAGE, "failed", seconds, detail)
            seconds = monotonic() - begun
            ended = _stop(proc)
        finally:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind in its group
            proc.wait()
    return StageResult(
        RESUME_STAGE,
        "ok",
        seconds,
        f"the trainer ({Path(argv[0]).name}) resumed from {path.name} and reported {done} "
        f"steps ({steps} asked); {ended}",
    )


def resumed_steps(watch_dir: Path) -> int:
    """Steps the trainer reported in ``watch_dir`` since its first report (0: none)."""
    current = read_steps(watch_dir).current
    return 0 if current is None else max(0, current.step - current.first_step + 1)


def _await_steps(
    proc: subprocess.Popen[bytes], request: ProofRequest, monotonic: Monotonic, begun: float
) -> tuple[int, int | None]:
    """Wait until the trainer reports its steps, exits, or runs out of time: the steps it
    reported, and its exit code (None: it still runs, ended here at the timeout)."""
    while True:
        code = proc.poll()
        done = resumed_steps(request.scratch)
        if done >= request.resume_steps or code is not None:
            return done, code
        if monotonic() - begun >= request.resume_timeout:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return done, None
        time.sleep(RESUME_POLL_SECONDS)


def _stop(proc: subprocess.Popen[bytes]) -> str:
    """Let the trainer that reached its steps exit, else end it (module doc)."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, sig)
        try:
            code = proc.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            continue
        return f"it exited {code}" if sig is None else f"it was stopped ({sig.name})"
    return "it did not exit"


def _tail(output: bytes | None) -> str:
    lines = [ln.strip() for ln in (output or b"").decode(errors="replace").splitlines()]
    last = next((ln for ln in reversed(lines) if ln), "")
    return f": {last[-OUTPUT_TAIL_CHARS:]}" if last else ""


def clear_stale(scratch_root: Path) -> list[Path]:
    """Remove what a drill that died left under ``scratch_root`` (only directories named
    as drills are); returns what was removed."""
    removed = []
    try:
        entries = list(scratch_root.iterdir())
    except OSError:
        return []
    for entry in entries:
        if _DRILL_DIR.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


__all__ = ["Proof", "ProofRequest", "clear_stale", "disk_problems", "prove"]
