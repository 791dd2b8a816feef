"""``ckptd exec`` after a notice waits for the trainer's own save for it, even when a
routine save finished around the notice counted as the emergency checkpoint and committed
first (``ckptd.supervision.exec_flush``). The fleet campaign (#48) lost two steps so on a
loaded machine: a follower node committed the routine ``step-40``, stopped, and left the
save the ranks made for the notice, ``step-42``, uncommitted.

The trainer is a script, so the order is the test's: ``step-2`` is being written when the
notice comes and is finished on the signal (the emergency checkpoint by the rule), then,
after that one has committed, the trainer writes ``step-3`` and exits at once. Checked on
the bytes: the restored ``step-3`` is what the trainer wrote."""

from __future__ import annotations

import signal
import sys
import textwrap
from pathlib import Path

from tests.process.test_exec import _quick_node
from tests.support.daemon import run_cli, wait_until

TRAINER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    run = pathlib.Path(sys.argv[1])
    told = []
    signal.signal(signal.SIGUSR1, lambda *_: told.append(1))

    def write(name, data, complete=True):
        d = run / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "weights.bin").write_bytes(data)
        if complete:
            (d / "COMPLETE").write_text("")

    write("step-1", os.urandom(4096))
    write("step-2", os.urandom(4096), complete=False)
    (run.parent / "ready").write_text("")
    while not told:
        time.sleep(0.01)
    (run / "step-2" / "COMPLETE").write_text("")  # the emergency checkpoint by the rule
    while not (run.parent / "go-on").exists():  # the test says when step-2 committed
        time.sleep(0.01)
    write("step-3", os.urandom(1 << 20))  # the save made for the notice, after it
    """
)


def test_exec_waits_for_the_save_made_for_the_notice_after_an_earlier_one_committed(
    tmp_path: Path,
) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    node = _quick_node(tmp_path, [sys.executable, str(script), str(tmp_path / "node" / "run")])
    try:
        node.start()
        wait_until(lambda: (tmp_path / "node" / "ready").exists(), 60, "the trainer ready")
        wait_until(
            lambda: "step-1" in [e["checkpoint"] for e in node.events("checkpoint_committed")],
            60,
            "step-1 committed",
        )
        node.signal(signal.SIGTERM)
        wait_until(lambda: node.events("emergency_checkpoint_committed"), 60, "step-2 committed")
        (tmp_path / "node" / "go-on").write_text("")
        code = node.wait_exit(60)
    finally:
        node.close()
    assert code == 0, node.log_tail()
    (first,) = node.events("emergency_checkpoint_committed")
    assert first["checkpoint"] == "step-2", first
    (superseded,) = node.events("emergency_checkpoint_superseded")
    assert (superseded["checkpoint"], superseded["older"]) == ("step-3", "step-2")
    (preempted,) = node.events("exec_preempted")
    assert preempted["emergency_checkpoint"] == "step-3" and preempted["committed"], preempted
    # On the bytes: what the store gives back is what the trainer wrote.
    out = tmp_path / "restored"
    done = run_cli(
        "restore",
        "--dest",
        f"file://{tmp_path / 'store'}",
        "--run",
        "run",
        "--latest",
        "--to",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    written = (tmp_path / "node" / "run" / "step-3" / "weights.bin").read_bytes()
    assert (out / "step-3" / "weights.bin").read_bytes() == written
