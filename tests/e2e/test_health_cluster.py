"""A health save agreed across the nodes of a job (docs/health.md, "What each action
does"): two ``ckptd run`` daemons ([cluster] nodes = 2) on SeaweedFS, a real trainer beside
each that saves its part on SIGUSR1 and trains on (layout quiescent: a node's part holds
its own weights file, no framework's whole layout); a degrading Xid in node 0's kernel log
(a file of ``/dev/kmsg`` records, tests/support/kernel_lines.py). Node 1 follows node 0's
NOTICE, both trainers save the same step, the checkpoint commits from both parts byte for
byte, and both nodes leave the save's emergency mode: the notice files go, the trainers
train on. The run ledger (``ckptd run``'s, from what it observes) marks no notice and no
interruption for it on either node."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from ckptd.devtools.locals3 import LocalS3
from ckptd.goodput.journal import read_ledger
from ckptd.goodput.model import Mark
from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from ckptd.storage.base import NotFoundError
from tests.support import kernel_lines as k
from tests.support.daemon import Daemon, wait_until
from tests.support.trainers.procs import script_env
from tests.support.writers import local_files


def test_a_health_save_on_one_node_is_saved_on_every_node_and_both_train_on(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    trainers: list[subprocess.Popen[bytes]] = []
    daemons: list[Daemon] = []
    roots = [tmp_path / f"node-{rank}" / "run" for rank in (0, 1)]
    try:
        for rank, root in enumerate(roots):
            root.mkdir(parents=True)
            node = root.parent
            trainers.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "tests.support.trainers.save_on_signal"),
                        *("--ckpt-dir", str(root), "--pidfile", str(node / "trainer.pid")),
                        *("--record", str(node / "signals"), "--mib", "1", "--part", f"n{rank}"),
                    ],
                    env=script_env(tmp_path),
                )
            )
            wait_until((node / "trainer.pid").exists, 30, f"trainer {rank} started")
            daemon = Daemon.configured(
                node,
                watch=[
                    {"dir": root, "run_id": "run", "layout": "quiescent", "quiescence_seconds": 0.5}
                ],
                dest=s3_dest,
                endpoint_url=local_s3.endpoint_url,
                state_dir=node / "state",
            )
            health = f'kmsg = "{kmsg}"' if rank == 0 else 'kmsg = ""'
            # SIGTERM a plain stop (as on a node that stays): each daemon ships its ledger.
            text = daemon.config.read_text()
            assert '[preemption]\nprovider = "none"\n' in text
            daemon.config.write_text(
                text.replace(
                    '[preemption]\nprovider = "none"\n',
                    '[preemption]\nprovider = "none"\nsigterm = "stop"\n',
                )
                + f'[trainer]\npidfile = "{node / "trainer.pid"}"\n'
                + f"[cluster]\nnodes = 2\nnode_rank = {rank}\npoll_interval_seconds = 0.2\n"
                + f'[health]\nenabled = true\npoll_interval_seconds = 0.2\n{health}\npsi = ""\n'
            )
            daemons.append(daemon.start())
        for d in daemons:
            wait_until(lambda d=d: d.events_named("ckptd_ready"), 30, "ready")
        with kmsg.open("a") as out:
            out.write(k.kmsg_record(1, k.XID_63) + "\n")
        d0, d1 = daemons
        (followed,) = wait_until(
            lambda: d1.events_named("notice_received"), 30, "node 1 follows", details=d1.log_text
        )
        assert (followed["source"], followed["kind"]) == ("node-0/health", "health-save")
        repo = Repository(open_backend(s3_dest, endpoint_url=local_s3.endpoint_url))

        def committed() -> bool:
            try:
                repo.resolve("run", "checkpoint-101")
            except NotFoundError:  # not committed yet
                return False
            return True

        wait_until(committed, 60, "checkpoint-101 committed from both parts", details=d1.log_text)
        wait_until(lambda: d0.events_named("health_save_done"), 30, "node 0's save done")
        for root in roots:
            notice = root / ".ckptd" / "preemption.json"
            wait_until(lambda n=notice: not n.exists(), 30, f"{notice} gone: the notice over")
        assert all(t.poll() is None for t in trainers), "both trainers train on"
        for root in roots:
            assert len((root.parent / "signals").read_text().splitlines()) == 1
        assert json.loads(d1._get("/v1/preemption")) == {"notice": False}
        for d in daemons:
            assert d.stop(60) == 0, d.log_text()
    finally:
        for d in daemons:
            d.__exit__()
        for t in trainers:
            t.send_signal(signal.SIGKILL)
            t.wait(timeout=10)
    manifest = repo.resolve("run", "checkpoint-101")
    stored = {
        f.path: repo.storage.get_bytes(object_key("run", manifest.checkpoint, f.path))
        for f in manifest.files
    }
    expected = {
        **local_files(roots[0] / "checkpoint-101"),
        **local_files(roots[1] / "checkpoint-101"),
    }
    assert sorted(stored) == ["model-n0.safetensors", "model-n1.safetensors", "trainer_state.json"]
    assert stored == expected
    marks = [r for r in read_ledger(repo, "run") if isinstance(r, Mark)]
    assert sum(m.kind == "stopped" for m in marks) == 2, marks  # both ledgers shipped
    assert not [m for m in marks if m.kind in ("notice", "interrupted")], marks
