"""``ckptd doctor``'s check of the health sources (``[health] enabled`` only): which of
them this node lets the daemon read, and which it does not (no ``/dev/kmsg`` access in a
container without ``CAP_SYSLOG``, no PSI on an old kernel, a cgroup that is not there,
no DCGM exporter answering, no NVML).

Each source is opened as the monitor would (``ckptd.health.readers``) and closed; nothing
is changed. An unreadable source is a warning: the others still protect the run.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptd.config import Settings
from ckptd.doctor.findings import Finding
from ckptd.health.dcgm import parse_exporter
from ckptd.health.nvml import INSTALL, NvmlReader
from ckptd.health.readers import KmsgReader, fetch_text, read_small

CHECK = "health"


def check_health(settings: Settings) -> list[Finding]:
    """One finding per configured source, and one for the condition file's directory;
    none with ``[health]`` off."""
    health = settings.health
    if not health.enabled:
        return []
    findings = []
    if health.kmsg:
        reader = KmsgReader(health.kmsg)
        opened = reader.open()
        reader.close()
        findings.append(
            Finding(CHECK, "ok", f"kernel log {health.kmsg}: readable (Xid, OOM kills, I/O errors)")
            if opened
            else Finding(
                CHECK,
                "warn",
                f"kernel log: {reader.unreadable}: no Xid, OOM-kill or I/O-error line is heard",
                "run the daemon as root or with CAP_SYSLOG (the DaemonSet: privileged, or "
                'mount /dev/kmsg), or set [health] kmsg = ""',
            )
        )
    if health.psi:
        findings.append(
            _file_finding(
                "memory pressure",
                Path(health.psi),
                "PSI needs Linux 4.20+ with CONFIG_PSI (psi=1 on the kernel's command line)",
            )
        )
    if health.cgroup:
        findings.append(
            _file_finding(
                "trainer's cgroup",
                Path(health.cgroup) / "memory.events",
                "set [health] cgroup to the trainer's cgroup v2 directory (cat /proc/PID/cgroup)",
            )
        )
    if health.dcgm_url:
        findings.append(_dcgm_finding(health.dcgm_url))
    if health.nvml:
        findings.append(_nvml_finding())
    condition = health.condition_path(Path(settings.state.dir))
    parent = next((p for p in (condition.parent, *condition.parents) if p.exists()), None)
    if parent is not None and os.access(parent, os.W_OK):
        findings.append(Finding(CHECK, "ok", f"condition file {condition}: can be written"))
    else:
        findings.append(
            Finding(
                CHECK,
                "warn",
                f"condition file {condition}: its directory cannot be written",
                "set [health] condition_file to a writable path",
            )
        )
    return findings


def _file_finding(what: str, path: Path, fix: str) -> Finding:
    if read_small(path) is not None:
        return Finding(CHECK, "ok", f"{what} {path}: readable")
    return Finding(CHECK, "warn", f"{what} {path}: cannot be read, so it is not watched", fix)


def _dcgm_finding(url: str) -> Finding:
    text, why = fetch_text(url)
    gpus = parse_exporter(text) if text is not None else []
    if gpus:
        return Finding(CHECK, "ok", f"DCGM exporter {url}: {len(gpus)} GPU(s) reported")
    return Finding(
        CHECK,
        "warn",
        f"DCGM exporter: {why or f'{url} names no GPU'}: no GPU's Xid, ECC or throttling is read",
        "run dcgm-exporter on the node (the GPU Operator's DaemonSet) and point "
        '[health] dcgm_url at its /metrics, or set dcgm_url = ""',
    )


def _nvml_finding() -> Finding:
    nvml = NvmlReader()
    gpus = nvml.readings()
    if nvml.unreadable is None:
        return Finding(CHECK, "ok", f"NVML: {len(gpus)} GPU(s) read")
    return Finding(
        CHECK,
        "warn",
        f"NVML: {nvml.unreadable}: no GPU's ECC, remapped rows or throttling is read",
        f"{INSTALL} beside ckptd, on a node with the NVIDIA driver, or set [health] nvml = false",
    )
