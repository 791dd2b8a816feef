"""Drive ``ckptd run`` as a real subprocess: config, start, wait, kill, read state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ckptd.devtools.locals3 import free_port


def die_with_parent() -> None:
    """``preexec_fn`` for a test's long-lived child (a daemon): SIGKILL when the process
    that started it dies (Linux's PR_SET_PDEATHSIG), so a killed test session leaves no
    daemon shipping into a store nobody reads."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.05,
    details: Callable[[], str] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``
    (the message adds ``details()``, e.g. the tail of a process's log)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


def read_pid(path: Path) -> int | None:
    """The pid a process wrote to ``path``; None until the file holds a whole number (a
    plain write: a read between its open and its write finds the file empty)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def run_cli(
    *args: str, config: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """One ``ckptd`` command as its own process (``--config`` appended if given), output
    captured; ``env`` is added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "ckptd", *args, *(["--config", str(config)] if config else [])],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def committed_manifest(s3: Any, prefix: str, run: str, name: str) -> dict[str, Any] | None:
    """The manifest document of ``run/name`` under ``prefix`` in bucket ckpt, or None (no
    manifest key, or a withdrawal there: the slot was never committed)."""
    try:
        body = s3.get_object(Bucket="ckpt", Key=f"{prefix}/{run}/{name}/ckptd.manifest.json")
    except s3.exceptions.NoSuchKey:
        return None
    doc = dict(json.loads(body["Body"].read()))
    return None if doc.get("format") == "ckptd.withdrawn/1" else doc


def write_config(
    path: Path,
    *,
    watch: list[dict[str, Any]],
    dest: str,
    endpoint_url: str = "",
    state_dir: Path,
    port: int,
    **destination: Any,
) -> Path:
    lines = []
    for w in watch:
        lines.append("[[watch]]")
        lines += [f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}" for k, v in w.items()]
    lines.append("[destination]")
    lines.append(f"url = {json.dumps(dest)}")
    lines.append(f"endpoint_url = {json.dumps(endpoint_url)}")
    lines += [f"{k} = {json.dumps(v)}" for k, v in destination.items()]
    lines += ["[preemption]", 'provider = "none"']
    lines += ["[metrics]", f'listen = "127.0.0.1:{port}"']
    lines += ["[state]", f"dir = {json.dumps(str(state_dir))}"]
    path.write_text("\n".join(lines) + "\n")
    return path


PORT_TRIES = 3


class PortTaken(Exception):
    """The daemon exited 2 because its ``metrics.listen`` port was taken."""


def _json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


@dataclass
class Daemon:
    """One ``ckptd run`` process; logs go to ``log_path`` as JSON lines."""

    config: Path
    log_path: Path
    port: int
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    # A host of the network-namespace rig (tests/support/netns.py): the daemon runs
    # inside it (``wrap``: ``ip netns exec NS``) and serves /metrics at its address.
    host: str = "127.0.0.1"
    wrap: list[str] = field(default_factory=list)
    _log_from: int = 0

    @classmethod
    def configured(cls, tmp: Path, *, name: str = "daemon", **config: Any) -> Daemon:
        port = free_port()
        cfg = write_config(tmp / f"{name}.toml", port=port, **config)
        return cls(cfg, tmp / f"{name}.log", port)

    def start(self) -> Daemon:
        """Start the daemon and wait until *this* process serves its port.

        ``free_port`` only says a port was free a moment ago: another test's daemon (the
        Slurm and campaign tests run in a second pytest beside the rest) may take it first.
        Then this daemon exits 2 naming ``metrics.listen`` while the other one answers
        ``/healthz``; so a start counts only once this process has logged
        ``http_listening`` on the port, and a port taken moves the daemon to a fresh one
        (config and ``port`` rewritten), three tries at most."""
        for attempt in range(1, PORT_TRIES + 1):
            self._spawn()
            try:
                wait_until(self._serving, 30, "daemon HTTP up", details=self.log_text)
                return self
            except PortTaken:
                if attempt == PORT_TRIES or not self._move_port():
                    raise AssertionError(
                        f"daemon could not listen on {self.host}:{self.port}:\n{self.log_text()}"
                    ) from None
            except BaseException:
                # __exit__ never runs when __enter__ (this) raises: a daemon left here would
                # run on after the test, shipping into a store nobody reads.
                self.proc.kill()  # type: ignore[union-attr]
                self.proc.wait()  # type: ignore[union-attr]
                raise
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                *self.wrap,
                *(sys.executable, "-m", "ckptd", "run", "--config", str(self.config)),
                *self.extra_args,
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent,
        )
        log.close()

    def _serving(self) -> bool:
        """This process logged ``http_listening`` on ``port`` and answers ``/healthz``;
        ``PortTaken`` when it exited 2 on that port, AssertionError (with its log) when it
        exited for another reason."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            since = self._log_since_start()
            if self.proc.returncode == 2 and "metrics.listen" in since and "cannot listen" in since:
                raise PortTaken
            raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log_text()}")
        listening = any(
            e.get("event") == "http_listening" and e.get("port") == self.port
            for e in _json_lines(self._log_since_start())
        )
        return listening and self._http_ok()

    def _log_since_start(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_from)
            return f.read().decode(errors="replace")

    def _move_port(self) -> bool:
        """Point the config (or ``CKPTD_METRICS__LISTEN``) at a fresh port; False when the
        port is named elsewhere, so the harness cannot move it."""
        fresh = free_port()
        env_listen = self.env.get("CKPTD_METRICS__LISTEN", "")
        host, _, port = env_listen.rpartition(":")
        if port == str(self.port):
            self.env["CKPTD_METRICS__LISTEN"] = f"{host}:{fresh}"
        else:
            text, named = self.config.read_text(), f':{self.port}"'
            if text.count(named) != 1:
                return False
            self.config.write_text(text.replace(named, f':{fresh}"'))
        self.port = fresh
        return True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _http_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def _get(self, path: str, timeout: float = 5) -> bytes:
        """GET ``path``; a failure says whether the daemon still runs, and ends with its
        log (a bare "connection refused" said neither)."""
        try:
            with urllib.request.urlopen(
                f"http://{self.host}:{self.port}{path}", timeout=timeout
            ) as r:
                return bytes(r.read())
        except urllib.error.HTTPError:
            raise
        except OSError as exc:
            state = (
                "running"
                if self.alive()
                else f"exited {self.proc.returncode if self.proc else '?'}"
            )
            raise AssertionError(
                f"GET {path} on {self.host}:{self.port} failed ({exc}); the daemon is {state}; "
                f"its log:\n{self.log_text()[-6000:]}"
            ) from exc

    def get_json(self, path: str) -> Any:
        return json.loads(self._get(path))

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = self._get("/metrics").decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def events(self) -> list[dict[str, Any]]:
        return _json_lines(self.log_path.read_text(errors="replace"))

    def events_named(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events()
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items())
        ]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("daemon did not stop on SIGTERM") from None

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
