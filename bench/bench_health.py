"""The cost of ``[health]`` (docs/health.md, "Cost"): CPU per poll with every source on,
and the daemon's RSS with ``[health]`` on against off.

    .venv/bin/python bench/bench_health.py            # ~40 s on 2 cores

CPU per poll: ``HealthMonitor.read`` (what a poll does in its thread) over the real
``/dev/kmsg`` (needs root or CAP_SYSLOG; a file of records otherwise), the real
``/proc/pressure/memory``, a cgroup v2 directory's four files (a copy, where the node
runs cgroup v1), and one watch dir; ``time.process_time`` over 2000 polls. RSS: a
``ckptd run`` to a ``file://`` store, idle, its ``VmRSS`` after 10 s, once with
``[health] enabled`` and once without.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckptd.config import load_settings
from ckptd.health.monitor import HealthMonitor, RunView
from ckptd.runtime.logs import get_logger
from ckptd.runtime.metrics import Metrics

POLLS = 2000
PSI = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def cpu_per_poll(tmp: Path) -> dict[str, object]:
    cgroup = tmp / "cgroup"
    cgroup.mkdir()
    for name, text in {
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.current": "1073741824\n",
        "memory.max": "8589934592\n",
        "memory.pressure": PSI,
    }.items():
        (cgroup / name).write_text(text)
    kmsg = "/dev/kmsg" if os.access("/dev/kmsg", os.R_OK) else str(tmp / "kmsg")
    if kmsg != "/dev/kmsg":
        Path(kmsg).touch()
    config = tmp / "ckptd.toml"
    config.write_text(
        f'[health]\nenabled = true\nkmsg = "{kmsg}"\npsi = "/proc/pressure/memory"\n'
        f'cgroup = "{cgroup}"\n'
    )
    settings = load_settings(config, environ={})

    class Idle:
        def runs(self) -> dict[str, RunView]:
            return {"run": RunView(tmp, 1 << 30)}

    monitor = HealthMonitor(
        settings.health,
        tmp / "condition.json",
        Idle(),
        Metrics(),  # type: ignore[arg-type]
        wall=time.time,
        log=get_logger(),
    )
    views = Idle().runs()
    monitor.read(lambda: [], views)  # open the kernel log once, as the first poll does
    started = time.process_time()
    for _ in range(POLLS):
        monitor.read(lambda: [], views)
    per_poll = (time.process_time() - started) / POLLS
    return {"kmsg": kmsg, "cpu_ms_per_poll": round(per_poll * 1000, 3), "sources": monitor.sources}


def rss_kib(tmp: Path, health: bool) -> int:
    watch, store = tmp / f"watch-{health}", tmp / f"store-{health}"
    watch.mkdir()
    store.mkdir()
    config = tmp / f"run-{health}.toml"
    config.write_text(
        f'[[watch]]\ndir = "{watch}"\n[destination]\nurl = "file://{store}"\n'
        '[preemption]\nprovider = "none"\n[metrics]\nlisten = "127.0.0.1:0"\n'
        f'[state]\ndir = "{tmp / f"state-{health}"}"\n'
        + ("[health]\nenabled = true\n" if health else "")
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptd", "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(10)
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        result = {
            **cpu_per_poll(tmp),
            "rss_kib_health_off": rss_kib(tmp, False),
            "rss_kib_health_on": rss_kib(tmp, True),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
