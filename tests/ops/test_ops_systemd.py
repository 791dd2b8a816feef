"""The systemd unit: it verifies, it is hardened, and what it forbids ckptd does not need.

``systemd-analyze`` (Debian package ``systemd``) is used when present; without it those
tests skip. No running systemd is needed: ``verify`` and ``security --offline`` read files.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import wait_until
from tests.support.ops import SYSTEMD, hf_daemon, tool
from tests.support.writers import write_hf

UNIT = SYSTEMD / "ckptd.service"
DRILL_UNIT = SYSTEMD / "ckptd-drill.service"
DRILL_TIMER = SYSTEMD / "ckptd-drill.timer"
MAX_EXPOSURE = 2.0  # systemd-analyze security: 0 (locked down) .. 10 (unprotected)

needs_systemd_analyze = pytest.mark.skipif(
    tool("systemd-analyze") is None, reason="systemd-analyze not installed (apt: systemd)"
)


def _directives(path: Path) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit file, by key, in order (keys may repeat)."""
    out: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_is_type_notify_with_watchdog_and_a_stop_timeout_above_the_flush() -> None:
    d = _directives(UNIT)
    assert d["Type"] == ["notify"]
    assert d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"] == ["30"]
    assert d["Restart"] == ["on-failure"]
    exec_start = shlex.split(d["ExecStart"][0])
    # Found on systemd's PATH wherever pip put it; verify checks /usr/bin/env exists.
    assert exec_start[:3] == ["/usr/bin/env", "ckptd", "run"]
    flush = float(exec_start[exec_start.index("--shutdown-timeout") + 1])
    assert float(d["TimeoutStopSec"][0]) >= flush + 20, "systemd would SIGKILL mid-flush"


def test_unit_hardening_is_present() -> None:
    d = _directives(UNIT)
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "read-only",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "StateDirectory": "ckptd",
        "CapabilityBoundingSet": "",
    }
    for key, value in expected.items():
        assert d.get(key) == [value], key
    assert "@system-service" in d["SystemCallFilter"]


def test_unit_yields_to_the_trainer_as_the_daemons_own_defaults_do() -> None:
    """Nice=/IOScheduling* equal [resources]' defaults: the daemon finds them set and
    makes no setpriority/ioprio_set call, which ~@resources would refuse."""
    from ckptd.config import ResourcesConfig

    d = _directives(UNIT)
    defaults = ResourcesConfig()
    assert d["Nice"] == [str(defaults.nice)]
    assert d["IOSchedulingClass"] == [defaults.io_class]
    assert d["IOSchedulingPriority"] == [str(defaults.io_priority)]
    assert 1 <= int(d["CPUWeight"][0]) < 100 and 1 <= int(d["IOWeight"][0]) < 100
    assert "@resources" in " ".join(d["SystemCallFilter"])


@needs_systemd_analyze
def test_unit_passes_systemd_analyze_verify_as_shipped() -> None:
    result = subprocess.run(
        [tool("systemd-analyze") or "", "verify", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    # verify reports unknown or misspelt directives ("ckptd.service:12: Unknown key
    # name ...") on stderr and may still exit 0.
    assert "ckptd.service:" not in result.stderr, result.stderr


def test_drill_timer_drills_weekly_with_jitter_through_the_running_daemon() -> None:
    """The alternative to [drill] every: a weekly timer, its start spread over a day, made
    up after downtime, starting one `ckptd drill` as the daemon's user (its socket)."""
    from ckptd.cli.main import build_parser

    timer = _directives(DRILL_TIMER)
    assert timer["OnCalendar"] == ["Mon *-*-* 00:00:00"]
    assert timer["RandomizedDelaySec"] == ["1d"] and timer["Persistent"] == ["true"]
    drill, daemon = _directives(DRILL_UNIT), _directives(UNIT)
    assert drill["Type"] == ["oneshot"]
    assert (drill["User"], drill["Group"]) == (daemon["User"], daemon["Group"])
    assert drill["Requisite"] == ["ckptd.service"]  # a drill never starts the daemon
    argv = shlex.split(drill["ExecStart"][0])
    assert argv[:3] == ["/usr/bin/env", "ckptd", "drill"] and "--restore-only" not in argv
    build_parser().parse_args(argv[2:])  # exits 2 on a bad flag
    deadline = float(argv[argv.index("--deadline") + 1])
    assert _seconds(drill["TimeoutStartSec"][0]) > deadline


def _seconds(value: str) -> float:
    units = {"s": 1, "min": 60, "h": 3600, "d": 86400}
    number = re.fullmatch(r"([0-9.]+)(s|min|h|d)?", value)
    assert number, value
    return float(number.group(1)) * units[number.group(2) or "s"]


@needs_systemd_analyze
@pytest.mark.parametrize("unit", [DRILL_UNIT, DRILL_TIMER], ids=lambda p: p.name)
def test_drill_units_pass_systemd_analyze_verify(unit: Path) -> None:
    result = subprocess.run(
        [tool("systemd-analyze") or "", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"{unit.name}:" not in result.stderr, result.stderr


@needs_systemd_analyze
def test_unit_exposure_score_is_low() -> None:
    result = subprocess.run(
        [tool("systemd-analyze") or "", "security", "--offline=true", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "offline" in result.stderr and "Unknown" in result.stderr:
        pytest.skip("systemd-analyze security --offline needs systemd >= 250")
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


def test_example_config_is_valid() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptd",
            "config",
            "check",
            "--config",
            str(SYSTEMD / "ckptd.toml.example"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert 'dir = "/var/lib/ckptd"' in result.stdout  # the unit's StateDirectory=


PR_SET_MDWE, PR_GET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 66, 1
WX = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC

# Runs before ckptd is imported (PYTHONPATH=<dir>): the kernel's own
# "memory-deny-write-execute" (Linux >= 6.3), which, like systemd's seccomp filter for
# MemoryDenyWriteExecute=, refuses writable+executable mappings and is inherited.
SITECUSTOMIZE = textwrap.dedent(
    f"""
    import ctypes
    _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_MDWE) failed: errno %d" % ctypes.get_errno())
    """
)


def _mdwe_supported() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_GET_MDWE, 0, 0, 0, 0) >= 0)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _mdwe_supported(),
    reason="kernel without PR_SET_MDWE (Linux < 6.3)",
)
def test_daemon_commits_under_memory_deny_write_execute(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """MemoryDenyWriteExecute=yes must not break CPython, aiohttp, boto3 or awscrt."""
    site = tmp_path / "mdwe"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    # The restriction is real in the child: a W+X mapping is refused.
    probe = subprocess.run(
        [sys.executable, "-c", f"import mmap; mmap.mmap(-1, 4096, prot={WX})"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr
    daemon, root = hf_daemon(tmp_path, local_s3, s3_dest, env=env)
    with daemon:
        write_hf(root, 10)
        wait_until(
            lambda: daemon.metric("ckptd_checkpoints_committed_total", run="run1") >= 1,
            60,
            "commit under MDWE",
        )
        assert daemon.stop() == 0
    assert "Traceback" not in daemon.log_text()


SYSUSERS = SYSTEMD / "ckptd.sysusers"


@pytest.mark.skipif(tool("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_sysusers_file_creates_the_units_user_with_the_state_dir_as_home(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        [tool("systemd-sysusers") or "", f"--root={tmp_path}", str(SYSUSERS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    users = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc" / "passwd").read_text().splitlines()
    }
    d = _directives(UNIT)
    (user,) = d["User"]
    assert user in users, "User= of the unit is not created by the sysusers file"
    entry = users[user]
    assert 0 < int(entry[2]) < 1000  # a system user
    assert entry[5] == f"/var/lib/{d['StateDirectory'][0]}"
    assert entry[6].endswith("nologin")
    # The header's install lines use this very file.
    assert "systemd/ckptd.sysusers /etc/sysusers.d/ckptd.conf" in UNIT.read_text()


@pytest.mark.skipif(os.geteuid() != 0 or tool("setpriv") is None, reason="needs root and setpriv")
def test_config_installed_as_the_header_says_is_readable_by_the_service_user(
    ckptd_for_other_users: list[str],
) -> None:
    """The header installs the config root-owned with the mode it names; the service user
    (not root, no group of root's) must be able to read it, or the unit exits 2 and
    RestartPreventExitStatus=2 never retries."""
    mode = re.search(r"install -D -m (\d+) systemd/ckptd.toml.example", UNIT.read_text())
    assert mode, "the header no longer says how to install the config"
    shared = Path(tempfile.mkdtemp(prefix="ckptd-unit-"))
    try:
        shared.chmod(0o755)
        config = shared / "ckptd.toml"
        shutil.copyfile(SYSTEMD / "ckptd.toml.example", config)
        config.chmod(int(mode.group(1), 8))
        result = subprocess.run(
            [
                tool("setpriv") or "",
                "--reuid=999",
                "--regid=999",
                "--clear-groups",
                *ckptd_for_other_users,
                "config",
                "check",
                "--config",
                str(config),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)
