"""End-to-end demo on the embedded local S3: ``python -m ckptd.devtools.demo``.

Starts SeaweedFS on loopback, runs the daemon beside a toy trainer that saves
Hugging Face-shaped checkpoints (``trainer_state.json`` last), waits for each to be
committed, then lists and verifies them with the CLI. Everything lives under
``--dir`` (default ``./.demo``); nothing is written elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from ckptd.devtools.locals3 import LocalS3, free_port


def toy_trainer_save(root: Path, step: int, weights: bytes) -> Path:
    """Save like transformers' Trainer: model, optimizer, RNG, then trainer_state.json."""
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.safetensors").write_bytes(weights)
    (d / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 64}))
    (d / "optimizer.pt").write_bytes(os.urandom(len(weights) // 2))
    (d / "rng_state.pth").write_bytes(os.urandom(14_000))
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "loss": 1.0 / step}))
    return d


def _status(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=2) as resp:
        return dict(json.loads(resp.read()))


def _last_step(port: int) -> object:
    runs: Any = _status(port)["runs"]
    return (runs["demo-run"]["last_committed"] or {}).get("step")


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"demo: timed out waiting for {what}")


def _write_config(base: Path, ckpt_dir: Path, endpoint_url: str, port: int) -> Path:
    """The daemon's config: one watch dir, the embedded S3, metrics on ``port``."""
    config = base / "ckptd.toml"
    config.write_text(
        "\n".join(
            [
                "[[watch]]",
                f'dir = "{ckpt_dir}"',
                "settle_seconds = 0.5",
                "[destination]",
                'url = "s3://ckpt/demo"',
                f'endpoint_url = "{endpoint_url}"',
                "part_size_mib = 8",
                "[preemption]",
                'provider = "none"',
                "[metrics]",
                f'listen = "127.0.0.1:{port}"',
                "[state]",
                f'dir = "{base / "state"}"',
            ]
        )
        + "\n"
    )
    return config


def _train(ckpt_dir: Path, port: int, steps: int, mib: int) -> None:
    """The toy trainer saves ``steps`` checkpoints, each awaited until committed."""
    for step in range(1, steps + 1):
        step_no = step * 100
        print(f"== toy trainer saves checkpoint-{step_no} ({mib} MiB model)")
        toy_trainer_save(ckpt_dir, step_no, os.urandom(mib * 1024 * 1024))
        started = time.monotonic()
        _wait(lambda s=step_no: _last_step(port) == s, 120, f"checkpoint-{step_no} to commit")
        print(f"   committed in {time.monotonic() - started:.1f}s")


def _ckptd(*argv: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "ckptd", *argv], env=env, check=True)


def _use_the_cli(base: Path, config: Path, endpoint_url: str, env: dict[str, str]) -> None:
    """List, verify and restore what the daemon committed, as a user would."""
    common = ["--dest", "s3://ckpt/demo", "--endpoint-url", endpoint_url, "--config", str(config)]
    print("== ckptd list")
    _ckptd("list", *common, env=env)
    print("== ckptd verify --latest (re-reads every object, checks CRC-32C)")
    _ckptd("verify", "--run", "demo-run", "--latest", *common, env=env)
    fresh = base / "fresh-node"
    print(f"== ckptd restore --latest --to {fresh} (a new node resuming)")
    _ckptd(
        "restore",
        *("--run", "demo-run", "--latest", "--to", str(fresh), "--no-progress"),
        *common,
        env=env,
    )


def _print_metrics(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        wanted = (
            "ckptd_checkpoints_committed_total",
            "ckptd_upload_bytes_total",
            "ckptd_last_committed_step",
        )
        print("== metrics")
        for line in resp.read().decode().splitlines():
            if line.startswith(wanted):
                print("  ", line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path(".demo"), help="scratch dir (wiped first)")
    parser.add_argument("--steps", type=int, default=3, help="checkpoints the toy trainer saves")
    parser.add_argument("--mib", type=int, default=24, help="model size in MiB")
    args = parser.parse_args()
    base = args.dir.absolute()
    shutil.rmtree(base, ignore_errors=True)
    ckpt_dir = base / "checkpoints" / "demo-run"
    ckpt_dir.mkdir(parents=True)

    print(f"== starting SeaweedFS (embedded S3) on loopback, data in {base / 's3'}")
    with LocalS3(base / "s3") as s3:
        env = {**os.environ, **s3.env()}
        env.pop("AWS_PROFILE", None)
        port = free_port()
        config = _write_config(base, ckpt_dir, s3.endpoint_url, port)
        print(f"== starting ckptd (config {config}); its JSON logs go to {base / 'ckptd.log'}")
        with open(base / "ckptd.log", "wb") as log:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "ckptd", "run", "--config", str(config)],
                stdout=log,
                stderr=log,
                env=env,
            )
        try:
            _wait(lambda: _status(port), 30, "the daemon")
            _train(ckpt_dir, port, args.steps, args.mib)
            _use_the_cli(base, config, s3.endpoint_url, env)
            _print_metrics(port)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)
    print("== demo done: daemon and SeaweedFS stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
