"""The Docker sidecar for real: deploy/Dockerfile built with podman, and the compose
scenario (toy trainer + ckptd sidecar sharing the checkpoint volume and the trainer's
PID namespace) run as containers that ship to SeaweedFS on loopback.

Compose itself is not run: its SeaweedFS image comes from Docker Hub, which these
machines cannot reach. The test reads deploy/docker-compose.yml and starts its
``trainer`` and ``ckptd`` services with podman exactly as compose wires them (image,
entrypoint, command, environment, shared named volume, ``pid: service:trainer``, stop
grace period); the ``seaweedfs`` service is the test session's SeaweedFS on loopback,
reached over the host network. Only the endpoint, the destination prefix, the S3
credentials and the HTTP port are swapped for the test's own.

Cost: the base image (debootstrap) is built once and cached in podman's store by tag,
the dependency wheels in /var/tmp by pyproject's hash; the module takes ~1.5 min cold on
an idle 2-core machine (3.5-4.5 min under load) and 35-70 s warm (the ckptd image is
rebuilt from the tree on every run). Marked ``container``; ``make test`` (and so CI) runs it, ``pytest -m 'not
container'`` is the quick path.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import psutil
import pytest
import yaml

from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY, LocalS3, free_port
from tests.support import podman
from tests.support.daemon import wait_until
from tests.support.ops import DEPLOY, REPO

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(podman.available() is not None, reason=str(podman.available())),
    pytest.mark.timeout(1800),
]

COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
IMAGE = "localhost/ckptd:test"
WHEEL_CACHE = Path("/var/tmp/ckptd-test-wheels")


def _dependency_wheels() -> Path:
    """ckptd's dependencies as wheels, cached by the pyproject that pins them."""
    key = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    cached = WHEEL_CACHE / key
    if not (cached / ".complete").exists():
        shutil.rmtree(cached, ignore_errors=True)
        podman.build_wheels(REPO, cached)
        for own in cached.glob("ckptd-*.whl"):
            own.unlink()  # built fresh from the tree on every run
        (cached / ".complete").touch()
    return cached


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ckptd image, from deploy/Dockerfile on the debootstrap base, as docs/operations.md says:
    wheels built on the host into dist/, then the build."""
    base = podman.ensure_base_image()
    context = tmp_path_factory.mktemp("image-context")
    dist = context / "dist"
    shutil.copytree(_dependency_wheels(), dist, ignore=shutil.ignore_patterns(".complete"))
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--wheel-dir", str(dist), str(REPO)),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    yield podman.build_image(DOCKERFILE, context, IMAGE, {"BASE_IMAGE": base})
    # Each build leaves the previous image's layers untagged; the base stays cached.
    podman.podman("image", "prune", "-f", check=False)


def _service(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text())["services"][name])


def _seconds(value: str) -> int:
    return int(float(value.rstrip("s")))


def _volumes(service: dict[str, Any], names: dict[str, str]) -> list[str]:
    """compose ``volumes:`` as podman ``-v`` options, named volumes renamed per test."""
    out = []
    for spec in service.get("volumes", []):
        volume, target = spec.split(":")[:2]
        out += ["-v", f"{names[volume]}:{target}"]
    return out


def _env(service: dict[str, Any], overrides: dict[str, str]) -> list[str]:
    env = {k: str(v) for k, v in service.get("environment", {}).items()}
    env.update(overrides)
    return [x for k, v in env.items() for x in ("-e", f"{k}={v}")]


def _http(port: int, path: str, method: str = "GET", timeout: float = 10) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return resp.status, resp.read()


def _committed(local_s3: LocalS3, dest: str, run: str) -> set[str]:
    """Checkpoints whose manifest is in the store (present = committed)."""
    bucket, _, prefix = dest.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=local_s3.endpoint_url)
    keys: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/{run}/"
    ):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith("/ckptd.manifest.json"):
                keys.add(obj["Key"].split("/")[-2])
    return keys


def _step(checkpoint: str) -> int:
    return int(checkpoint.rsplit("-", 1)[1])


@pytest.fixture
def names() -> Iterator[dict[str, str]]:
    """Per-test container and volume names; everything is removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    out = {
        "trainer": f"ckptd-test-trainer-{tag}",
        "ckptd": f"ckptd-test-sidecar-{tag}",
        "ckpt": f"ckptd-test-ckpt-{tag}",
        "ckptd-state": f"ckptd-test-state-{tag}",
    }
    try:
        yield out
    finally:
        podman.remove(out["ckptd"], out["trainer"])
        for volume in (out["ckpt"], out["ckptd-state"]):
            podman.podman("volume", "rm", "-f", volume, check=False)


def test_image_is_non_root_with_ckptd_entrypoint_and_healthcheck(image: str) -> None:
    (info,) = json.loads(podman.podman("image", "inspect", image).stdout)
    config = info["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["ckptd", "run"]
    version = podman.podman("run", "--rm", "--entrypoint", "ckptd", image, "--version")
    assert "0.1.0" in version.stdout
    whoami = podman.podman("run", "--rm", "--entrypoint", "id", image, "-u")
    assert whoami.stdout.strip() == "10001"
    # The HEALTHCHECK survived the build (Docker format; OCI images have none).
    health = info["Healthcheck"]
    assert health["Test"][0] == "CMD" and "/healthz" in health["Test"][-1], health


def test_compose_scenario_ships_drills_and_flushes_on_stop(
    image: str, names: dict[str, str], local_s3: LocalS3, s3_dest: str
) -> None:
    trainer, sidecar = _service("trainer"), _service("ckptd")
    assert sidecar["pid"] == "service:trainer"
    port = free_port()
    script, marker = trainer["command"]
    run_trainer = podman.podman(
        "run",
        "-d",
        "--name",
        names["trainer"],
        "--network=host",
        "--stop-timeout",
        str(_seconds(trainer["stop_grace_period"])),
        *_volumes(trainer, names),
        "--entrypoint",
        json.dumps(trainer["entrypoint"]),
        image,
        script,
        marker,
    )
    assert run_trainer.returncode == 0
    args = list(sidecar["command"])
    args[args.index("--endpoint-url") + 1] = local_s3.endpoint_url
    args[args.index("--dest") + 1] = s3_dest
    run = args[args.index("--run") + 1]
    grace = _seconds(sidecar["stop_grace_period"])
    flush = float(args[args.index("--shutdown-timeout") + 1])
    overrides = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        # Host network: a port of the test's own, not compose's published 9464.
        "CKPTD_METRICS__LISTEN": f"127.0.0.1:{port}",
    }
    podman.podman(
        "run",
        "-d",
        "--name",
        names["ckptd"],
        "--network=host",
        "--pid",
        f"container:{names['trainer']}",
        "--stop-timeout",
        str(grace),
        *_volumes(sidecar, names),
        *_env(sidecar, overrides),
        image,
        *args,
    )

    def healthy() -> bool:
        try:
            return _http(port, "/healthz", timeout=2)[0] == 200
        except OSError:
            return False

    wait_until(healthy, 120, "the sidecar's /healthz")
    # The image's own HEALTHCHECK command, run by the engine inside the container.
    assert podman.podman("healthcheck", "run", names["ckptd"], check=False).returncode == 0
    # The sidecar yields ([resources] defaults: nice 19, best-effort I/O level 7); the
    # trainer beside it keeps its own priority.
    pids = {
        name: json.loads(podman.podman("inspect", names[name]).stdout)[0]["State"]["Pid"]
        for name in ("ckptd", "trainer")
    }
    sidecar_threads = psutil.Process(pids["ckptd"]).threads()
    assert {psutil.Process(t.id).nice() for t in sidecar_threads} == {19}
    assert {tuple(psutil.Process(t.id).ionice()) for t in sidecar_threads} == {
        (psutil.IOPRIO_CLASS_BE, 7)
    }
    assert psutil.Process(pids["trainer"]).nice() == psutil.Process().nice()
    status, metrics = _http(port, "/metrics")
    assert status == 200 and b"ckptd_checkpoints_committed_total" in metrics

    # A drill, as an operator runs it (`docker compose exec ckptd ckptd drill`: the
    # control socket in the container's state dir): ckptd finds the trainer in the
    # shared PID namespace (trainer.match) and signals it; the trainer saves and the
    # save is committed before the deadline.
    drilled = podman.podman(
        "exec", names["ckptd"], "ckptd", "drill", "--deadline", "60", "--json", timeout=120
    )
    drill = json.loads(drilled.stdout)
    assert drill["trainer_pids"], drill
    assert drill["committed_before_deadline"], drill
    wait_until(lambda: _committed(local_s3, s3_dest, run), 30, "the drill's checkpoint in S3")
    before = _committed(local_s3, s3_dest, run)

    # podman stop = SIGTERM = a preemption notice: ckptd signals the trainer, which
    # saves once more, ships it and exits 0 well inside the grace period.
    started = time.monotonic()
    stop = podman.podman("stop", "-t", str(grace), names["ckptd"], timeout=grace + 60)
    elapsed = time.monotonic() - started
    logs = podman.podman("logs", names["ckptd"], check=False)
    state = json.loads(podman.podman("inspect", names["ckptd"]).stdout)[0]["State"]
    assert stop.returncode == 0
    assert state["ExitCode"] == 0, logs.stdout[-3000:] + logs.stderr[-3000:]
    assert elapsed < min(grace, flush), f"stop took {elapsed:.1f}s"
    after = _committed(local_s3, s3_dest, run)
    newer = {c for c in after - before if _step(c) > max(_step(c) for c in before)}
    assert newer, f"no checkpoint flushed on stop: before {before}, after {after}"
    print(f"stop flushed {sorted(newer)} in {elapsed:.1f}s (grace {grace}s)")
