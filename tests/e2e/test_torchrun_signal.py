"""A real ``torchrun`` under the daemon (issue #31): ``trainer.match`` names the script,
so torchrun's own command line matches too, and so does a pager on the script; neither
handles SIGUSR1, whose default action would end them. A drill signals the two ranks
only: they save, the emergency checkpoint commits, torchrun and the pager live on (each
logged once as spared) and the job exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from ckptd.devtools.locals3 import LocalS3, free_port
from ckptd.runtime.processes import catches_signal
from tests.support.daemon import run_cli, wait_until
from tests.support.ops import hf_daemon

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "trainers" / "ddp_save_on_signal.py"


def test_a_drill_signals_torchruns_ranks_and_spares_torchrun_and_a_pager(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    env = {"CKPTD_TRAINER__MATCH": SCRIPT.name}
    daemon, root = hf_daemon(tmp_path, local_s3, s3_dest, env=env)
    torchrun = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(SCRIPT),
            str(root),
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    pager = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "less", str(SCRIPT)]
    )
    try:
        ready = [tmp_path / f"rank{i}.ready" for i in (0, 1)]
        wait_until(lambda: all(r.exists() for r in ready), 120, "both ranks' handlers")
        ranks = [int(r.read_text()) for r in ready]
        assert not catches_signal(torchrun.pid, signal.SIGUSR1)  # it would die of it
        with daemon:
            drill = run_cli("drill", "--deadline", "60", "--json", config=daemon.config)
            assert drill.returncode == 0, drill.stdout + drill.stderr
            report = json.loads(drill.stdout)
            assert sorted(report["trainer_pids"]) == sorted(ranks), report
            assert {torchrun.pid, pager.pid} <= set(report["skipped_pids"]), report
            assert report["committed_before_deadline"], report
            spared = {e["pid"]: e["cmdline"] for e in daemon.events_named("trainer_signal_skipped")}
            assert SCRIPT.name in spared[torchrun.pid] and SCRIPT.name in spared[pager.pid]
            assert pager.poll() is None
            # torchrun was spared: it collects its ranks and the job succeeds.
            output = torchrun.communicate(timeout=60)[0].decode(errors="replace")
            assert torchrun.returncode == 0, output[-3000:]
            assert pager.poll() is None
            assert daemon.stop() == 0
    finally:
        for proc in (torchrun, pager):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
