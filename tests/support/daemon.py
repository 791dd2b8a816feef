"""Drive ``ckptd run`` as a real subprocess: config, start, wait, kill, read state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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
    """The manifest document of ``run/name`` under ``prefix`` in bucket ckpt, or None."""
    try:
        body = s3.get_object(Bucket="ckpt", Key=f"{prefix}/{run}/{name}/ckptd.manifest.json")
    except s3.exceptions.NoSuchKey:
        return None
    return dict(json.loads(body["Body"].read()))


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

    @classmethod
    def configured(cls, tmp: Path, *, name: str = "daemon", **config: Any) -> Daemon:
        port = free_port()
        cfg = write_config(tmp / f"{name}.toml", port=port, **config)
        return cls(cfg, tmp / f"{name}.log", port)

    def start(self) -> Daemon:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
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
        try:
            wait_until(lambda: self.alive() and self._http_ok(), 30, "daemon HTTP up")
        except BaseException:
            # __exit__ never runs when __enter__ (this) raises: a daemon left here would
            # run on after the test, shipping into a store nobody reads.
            self.proc.kill()
            self.proc.wait()
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _http_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"daemon exited {self.proc.returncode}:\n{self.log_text()}"
                ) from None
            return False

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://{self.host}:{self.port}{path}", timeout=5) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"http://{self.host}:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

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
