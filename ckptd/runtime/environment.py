"""The software environment recorded in each manifest (``environment``), read from
package metadata only: importing torch in the daemon would cost seconds and hundreds
of MiB for a version string."""

from __future__ import annotations

import json
import platform
import re
from importlib import metadata
from pathlib import Path

import ckptd

_TRACKED = ("torch", "transformers", "lightning", "deepspeed", "jax", "numpy")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cuda(torch_version: str | None, cuda_root: Path) -> str | None:
    if torch_version:
        match = re.search(r"\+cu(\d+)(\d)$", torch_version)  # "2.5.1+cu124" -> 12.4
        if match:
            return f"{match.group(1)}.{match.group(2)}"
    try:
        info = json.loads((cuda_root / "version.json").read_text())
        return str(info["cuda"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def describe(cuda_root: Path = Path("/usr/local/cuda")) -> dict[str, str]:
    """Versions of ckptd, Python and the ML stack present on this node."""
    env = {"ckptd": ckptd.__version__, "python": platform.python_version()}
    for dist in _TRACKED:
        version = _version(dist)
        if version:
            env[dist] = version
    cuda = _cuda(env.get("torch"), cuda_root)
    if cuda:
        env["cuda"] = cuda
    return env
