"""A trainer that rolls back, as LLM training does after a loss spike
(``tests/process/test_rollback.py``): no model, HF-shaped checkpoints of random bytes.

Each start is one of ``--plan``'s lines, taken in order (the count kept in ``--attempts``):

    save STEPS...            start from scratch (or from CKPTD_RESUME_FROM), save these
    rollback NAME STEPS...   resume from the local checkpoint NAME instead, save these
    scratch STEPS...         start over from nothing, save these

A line may end with ``hang``: after its saves the trainer sleeps until it is killed (a
test kills it, and ``ckptd exec`` with it, at that instant); ``nowait hang``: it does not
wait for its saves' commits either (killed before them).

It reports what it resumed from with ``ckptd.trainer.report_resumed`` (the one call a
trainer makes), waits after each save until the store (a ``file://`` root, ``--store``)
holds a commit of that name, and exits ``--crash`` after its line when that line is not
the last (a crash ``ckptd exec`` restarts it after). A checkpoint it saves over an
existing one is moved to ``--kept`` first, so the test can compare the abandoned bytes.
With ``--seen``, each start appends one JSON line: its attempt and PID, the ``CKPTD_RESUME_FROM``
it was given, and the CRC-32C of that checkpoint's ``model.safetensors`` (which content
it was handed, not only which name).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import ckptd.trainer
from ckptd.core import checksum


def write_checkpoint(root: Path, step: int) -> None:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for name, size in (("model.safetensors", 200_000), ("optimizer.pt", 100_000)):
        (d / name).write_bytes(os.urandom(size))
    (d / "config.json").write_text('{"model_type": "toy"}')
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))  # last


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--run", default="run")
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--attempts", type=Path, required=True)
    p.add_argument("--kept", type=Path, required=True)
    p.add_argument("--crash", type=int, default=3)
    p.add_argument("--seen", type=Path, default=None)
    args = p.parse_args()
    plan = [line.split() for line in args.plan.read_text().splitlines() if line.strip()]
    attempt = int(args.attempts.read_text()) if args.attempts.exists() else 0
    args.attempts.write_text(str(attempt + 1))
    what, *rest = plan[attempt]
    hang = rest[-1:] == ["hang"]
    rest = rest[:-1] if hang else rest
    wait = rest[-1:] != ["nowait"]
    rest = rest if wait else rest[:-1]
    if args.seen is not None:
        _record_seen(args.seen, attempt)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    if what == "rollback":
        ckptd.trainer.report_resumed(args.ckpt_dir / rest[0], watch_dir=args.ckpt_dir)
        rest = rest[1:]
    elif what == "scratch":
        ckptd.trainer.report_resumed(None, watch_dir=args.ckpt_dir)
    else:
        resumed = ckptd.trainer.resume_from()
        ckptd.trainer.report_resumed(resumed, watch_dir=args.ckpt_dir)
    for step in (int(s) for s in rest):
        existing = args.ckpt_dir / f"checkpoint-{step}"
        if existing.exists():
            args.kept.mkdir(parents=True, exist_ok=True)
            shutil.move(str(existing), args.kept / f"checkpoint-{step}-attempt-{attempt}")
        before = time.monotonic()
        write_checkpoint(args.ckpt_dir, step)
        while wait and not _committed_now(
            args.store, args.run, args.ckpt_dir / f"checkpoint-{step}"
        ):
            if time.monotonic() - before > 120:
                print(f"checkpoint-{step} not committed in 120 s", file=sys.stderr)
                return 1
            time.sleep(0.1)
    while hang:
        time.sleep(1)  # until killed
    return args.crash if attempt + 1 < len(plan) else 0


def _record_seen(seen: Path, attempt: int) -> None:
    given = os.environ.get("CKPTD_RESUME_FROM")
    crc = None
    if given:
        model = Path(given) / "model.safetensors"
        crc = checksum.to_hex(checksum.crc32c(model.read_bytes())) if model.exists() else None
    line = {"attempt": attempt, "pid": os.getpid(), "resume_from": given, "model_crc32c": crc}
    with seen.open("a") as fh:
        fh.write(json.dumps(line) + "\n")


def _committed_now(store: Path, run: str, ckpt: Path) -> bool:
    """Whether some slot of ``ckpt``'s name holds a manifest of exactly these bytes (its
    model's CRC-32C): the daemon committed this save, not an earlier one of that name."""
    name = ckpt.name
    model = checksum.to_hex(checksum.crc32c((ckpt / "model.safetensors").read_bytes()))
    for slot in (store / run).glob(f"{name}*"):
        if slot.name != name and not slot.name.startswith(name + "~"):
            continue
        try:
            doc = json.loads((slot / "ckptd.manifest.json").read_text())
        except (OSError, ValueError):
            continue
        files = {f["path"]: f["crc32c"] for f in doc.get("files", [])}
        if doc.get("format") == "ckptd.manifest/1" and files.get("model.safetensors") == model:
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
