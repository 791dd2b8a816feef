"""Podman for the container test: a base image built from Debian packages, the ckptd
image built from deploy/Dockerfile, and containers run on the host network.

No image registry is reachable from CI machines, but Debian's mirror is: the base image
is a ``debootstrap --variant=minbase`` Debian bookworm with Python 3.11, imported into
podman's local store under :data:`BASE_IMAGE` and reused by every later run (a cold
build takes a few minutes; delete the image to rebuild it). ckptd and its dependencies
are installed in the image from wheels built on the host (``pip wheel``), as
docs/operations.md ("Docker sidecar") tells users to do.

This host has hybrid cgroups, on which crun fails, and refuses podman's default
ulimits: containers run with ``--runtime runc`` and :func:`containers_conf` (the
``CONTAINERS_CONF`` file) sets ``default_ulimits = []`` and the cgroupfs manager.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# Bump the suffix when the recipe below changes, so a cached image is not reused.
BASE_IMAGE = "localhost/ckptd-test-base:bookworm-py311-v1"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")

_CONF = """\
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
"""


def available() -> str | None:
    """Why the container test cannot run here, or None if it can."""
    missing = [t for t in ("podman", "runc", "debootstrap") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt: podman runc debootstrap; .ci/run installs them)"
    if os.geteuid() != 0:
        return "the container test builds its base image with debootstrap, which needs root"
    return None


def containers_conf() -> Path:
    path = Path(tempfile.gettempdir()) / "ckptd-test-containers.conf"
    if not path.exists() or path.read_text() != _CONF:
        path.write_text(_CONF)
    return path


def podman(
    *args: str,
    check: bool = True,
    timeout: float = 600,
    capture: bool = True,
    input: bytes | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``podman ARGS`` with runc and this host's containers.conf."""
    env = {**os.environ, "CONTAINERS_CONF": str(containers_conf())}
    result = subprocess.run(
        ["podman", "--runtime", "runc", *args],
        env=env,
        capture_output=capture,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"podman {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def ensure_base_image(tag: str = BASE_IMAGE) -> str:
    """The Debian + Python base image, built with debootstrap unless already present."""
    if image_exists(tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="ckptd-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            check=True,
            capture_output=True,
            timeout=1200,
        )
        # apt's caches are of no use in the image.
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for child in (rootfs / sub).glob("*"):
                if child.is_file():
                    child.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        env = {**os.environ, "CONTAINERS_CONF": str(containers_conf())}
        imported = subprocess.run(
            ["podman", "import", "--change", 'CMD ["/bin/bash"]', "-", tag],
            stdin=tar.stdout,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or imported.returncode != 0:
            raise RuntimeError(f"podman import {tag} failed: {imported.stderr}")
    return tag


def build_wheels(source: Path, wheel_dir: Path) -> list[Path]:
    """ckptd and every dependency as wheels, built on the host (the first step in docs/operations.md, "Docker sidecar")."""
    import sys

    wheel_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--wheel-dir",
            str(wheel_dir),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=900,
    )
    return sorted(wheel_dir.glob("*.whl"))


def build_image(
    dockerfile: Path, context: Path, tag: str, build_args: dict[str, str] | None = None
) -> str:
    # Docker's image format: the OCI one has no HEALTHCHECK, and podman would drop it.
    # No network in RUN steps: the wheels are all the build needs.
    args = ["build", "--pull=never", "--network=none", "--format", "docker"]
    args += ["-f", str(dockerfile), "-t", tag]
    for key, value in (build_args or {}).items():
        args += ["--build-arg", f"{key}={value}"]
    podman(*args, str(context), timeout=900)
    return tag


def run_detached(name: str, image: str, args: Sequence[str], options: Sequence[str] = ()) -> str:
    """Start a container on the host network; returns its id."""
    out = podman("run", "-d", "--name", name, "--network=host", *options, image, *args)
    return out.stdout.strip()


def remove(*names: str) -> None:
    for name in names:
        # -v: the anonymous volume of the image's VOLUME goes with the container.
        podman("rm", "-f", "-v", "-t", "0", name, check=False, timeout=120)
