"""What the one-shot commands' start-up leaves unimported (#46): aiohttp, the peering
modules, prometheus_client and psutil are loaded only by the features that use them, so
``ckptd restore`` and ``ckptd run --once`` with ``[peers]`` off do not pay for them.

Each case is a fresh interpreter: this process has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What each path imports, as its command's handler does before it touches a store.
RESTORE = (
    "ckptd.cli.main",
    "ckptd.cadence.advisor",
    "ckptd.repository",
    "ckptd.store.nearby",
    "ckptd.store.restore",
    "ckptd.store.tiers",
)
RUN_ONCE = ("ckptd.cli.main", "ckptd.daemon.service")

HEAVY = ("aiohttp", "ckptd.peers", "ckptd.daemon.peering", "ckptd.notices.zone")


def loaded_after(modules: tuple[str, ...]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    ("path", "also_unloaded"),
    [(RESTORE, ("prometheus_client", "psutil")), (RUN_ONCE, ())],
    ids=["restore", "run-once"],
)
def test_a_one_shot_command_imports_no_feature_it_does_not_use(
    path: tuple[str, ...], also_unloaded: tuple[str, ...]
) -> None:
    loaded = loaded_after(path)
    unwanted = (*HEAVY, *also_unloaded)
    found = sorted(m for m in loaded if any(m == u or m.startswith(u + ".") for u in unwanted))
    assert found == []
