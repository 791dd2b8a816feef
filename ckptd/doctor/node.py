"""``ckptd doctor``'s checks of this node: the trainer a notice would signal, free space
in the state and watch dirs, and the control API's socket and token.

They read what the daemon would read (``/proc``, the filesystems, the token file) and
change nothing; a socket is connected to, never bound.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from ckptd.config import ConfigError, Settings
from ckptd.config.control import (
    control_socket,
    control_tcp,
    read_token,
    token_exposure,
    token_source,
)
from ckptd.doctor.findings import (
    STATE_MIN_FREE_BYTES,
    WATCH_MIN_FREE_BYTES,
    Finding,
    free_space_finding,
)
from ckptd.notices.responder import find_trainer_pids
from ckptd.runtime.processes import PROC, catches_signal, cmdline_of

INSTALL_FIX = (
    "call ckptd.trainer.install() at the trainer's start-up (or use the Hugging Face or "
    "Lightning callback: docs/trainers.md)"
)


def check_trainer(settings: Settings) -> Finding:
    """Whether ``trainer.match`` / ``trainer.pidfile`` finds a process now, and whether it
    has a handler for the save signal (a process without one is spared, never signalled)."""
    trainer = settings.trainer
    signal_name = trainer.signal
    if not (trainer.pidfile or trainer.match):
        return Finding(
            "trainer",
            "warn",
            "trainer.match and trainer.pidfile are unset: a notice signals no process (the "
            "trainer learns of it only from its notice file; ckptd exec finds its own)",
            'set trainer.match = "train.py" (text of the trainer\'s command line), or '
            "trainer.pidfile",
        )
    how = (
        f"trainer.pidfile {trainer.pidfile}"
        if trainer.pidfile
        else f"trainer.match {trainer.match!r}"
    )
    pids = find_trainer_pids(trainer.pidfile, trainer.match)
    alive = [p for p in pids if (PROC / str(p)).exists()]  # a pidfile may name one gone
    if not alive:
        return Finding(
            "trainer",
            "warn",
            f"{how} finds no process now: a notice would signal nobody",
            "start the trainer before relying on notices (run doctor again then), or "
            "correct the setting",
        )
    handling = [p for p in alive if catches_signal(p, trainer.signal_number)]
    spared = [p for p in alive if p not in handling]
    if not handling:
        named = "; ".join(f"{p} ({cmdline_of(p)[:80]})" for p in spared[:3])
        return Finding(
            "trainer",
            "warn",
            f"{how} finds {len(alive)} process(es), none with a handler for {signal_name}: "
            f"each would be spared, not signalled: {named}",
            INSTALL_FIX,
        )
    message = f"{how} finds {len(handling)} process(es) handling {signal_name} ({', '.join(map(str, handling))})"
    if spared:
        message += f"; {len(spared)} without a handler would be spared (a launcher?)"
    return Finding("trainer", "ok", message)


def _existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (where it would be made)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_disk(settings: Settings) -> list[Finding]:
    """Free space in the state dir and each watch dir (bounds in ``findings``)."""
    places = [("state dir", Path(settings.state.dir), STATE_MIN_FREE_BYTES)]
    places += [("watch dir", Path(w.dir), WATCH_MIN_FREE_BYTES) for w in settings.watch]
    found = []
    for what, path, minimum in places:
        try:
            free = shutil.disk_usage(_existing(path)).free
        except OSError as exc:
            found.append(
                Finding("disk", "warn", f"{what} {path}: free space unknown ({exc.strerror})", "")
            )
            continue
        found.append(free_space_finding(what, str(path), free, minimum))
    return found


def check_token(settings: Settings) -> Finding:
    """The control API's token: readable, and by no one else (as ssh a private key)."""
    http = settings.http
    source = token_source(http)
    if source is None:
        if http.token.get_secret_value():
            return Finding(
                "token",
                "ok",
                "http.token is set in the config (http.token_file keeps it out of it)",
            )
        return Finding("token", "ok", "no token configured (the control socket's mode guards it)")
    try:
        read_token(http)
    except ConfigError as exc:
        return Finding(
            "token",
            "fail",
            f"{exc.key}: {exc.message}",
            "make the file readable by the daemon's user, holding one token",
        )
    exposure = token_exposure(http)
    if exposure:
        return Finding("token", "fail", exposure.rsplit("; chmod", 1)[0], f"chmod 600 {source}")
    return Finding("token", "ok", f"{source}: readable by the daemon's user only")


def check_control(settings: Settings) -> Finding:
    """Where ``ckptd status``/``drill``/``exec`` find the daemon: the socket's directory
    can hold it (and whether a daemon listens there now), or the TCP address."""
    path = control_socket(settings)
    if path is None:
        host, port = control_tcp(settings) or ("?", 0)
        guard = "with the token" if settings.http.has_token else "loopback only"
        return Finding("control", "ok", f"the control API listens on {host}:{port} ({guard})")
    if path.exists():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            try:
                sock.connect(str(path))
            except OSError:
                return Finding(
                    "control", "ok", f"{path}: left by a daemon that is gone (replaced at start-up)"
                )
        return Finding("control", "ok", f"{path}: a daemon listens there now")
    parent = _existing(path.parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        return Finding(
            "control",
            "fail",
            f"{path}: the daemon's user cannot create it (no write access to {parent})",
            "run the daemon as a user who may write state.dir, or set http.listen = "
            "unix:/another/path",
        )
    return Finding("control", "ok", f"{path}: the control socket will be made there")


__all__ = ["check_control", "check_disk", "check_token", "check_trainer"]
