"""What our own SIGTERM means: the node or pod going away, or a stop of ckptd alone.

SIGTERM is what systemd sends on ``systemctl stop|restart ckptd`` (an upgrade, a config
change) and on a machine shutdown; what the kubelet sends when a pod is deleted (node
drain, Spot reclaim, a DaemonSet rollout); what ``docker stop`` sends. Signalling the
trainer on a plain restart of the daemon stops training for nothing, so SIGTERM is a
preemption notice only when the machine or the pod goes away:

    preemption.sigterm = "notice"  always a notice (the behaviour before this setting)
    preemption.sigterm = "stop"    never: stop after the upload in flight, as SIGINT
    preemption.sigterm = "auto"    (default) under systemd (``$INVOCATION_ID``, set for
                                   every unit: systemd.exec(5)), a notice only while the
                                   system is shutting down (``systemctl
                                   is-system-running`` prints "stopping":
                                   systemctl(1)); in a Kubernetes pod
                                   (``$KUBERNETES_SERVICE_HOST``) a notice (a sidecar's
                                   pod ends with its trainer); elsewhere a notice

When systemd cannot be asked (no ``systemctl``, no D-Bus) the SIGTERM is taken as a
notice: a needless emergency save costs seconds, a missed one loses the work since the
last save.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ckptd.config import SigtermMode

SYSTEMCTL_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class SigtermMeaning:
    """Whether a SIGTERM is a preemption notice, and why (for the log)."""

    notice: bool
    why: str


def system_state(timeout: float = SYSTEMCTL_TIMEOUT_SECONDS) -> str | None:
    """systemd's state ("running", "degraded", "stopping", ...), or None when it cannot
    be asked. ``is-system-running`` exits non-zero for every state but "running", so the
    output is what counts."""
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return None
    try:
        done = subprocess.run(
            [systemctl, "is-system-running"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    state = done.stdout.strip()
    # "offline" and "unknown" are systemctl's words for "could not ask".
    return state if state and state not in ("offline", "unknown") else None


def sigterm_meaning(
    mode: SigtermMode,
    environ: Mapping[str, str],
    state: Callable[[], str | None] = system_state,
) -> SigtermMeaning:
    """Decide, at the moment the SIGTERM arrives, what it means (the module docstring)."""
    if mode == "notice":
        return SigtermMeaning(True, "preemption.sigterm = notice")
    if mode == "stop":
        return SigtermMeaning(False, "preemption.sigterm = stop")
    if environ.get("INVOCATION_ID"):
        current = state()
        if current is None:
            return SigtermMeaning(True, "systemd's state could not be read: taken as a shutdown")
        if current == "stopping":
            return SigtermMeaning(True, "systemd: the machine is shutting down")
        return SigtermMeaning(
            False, f"systemd: the system is {current}, so this stops or restarts ckptd alone"
        )
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return SigtermMeaning(True, "Kubernetes: the pod is terminating")
    return SigtermMeaning(True, "not under systemd: SIGTERM is taken as a preemption")
