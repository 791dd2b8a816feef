"""Every test under tests/e2e carries the marker ``e2e``: ``make test`` runs them in its
second pytest, beside the rest of the suite (Makefile, ``BESIDE``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.support.harness import Env, TrainerSpec
from tests.support.health_exec import HealthExec, start_health_exec

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def health_exec(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> Iterator[Callable[..., HealthExec]]:
    """``start_health_exec`` on SeaweedFS in ``tmp_path``; every node started is closed
    (killed if still running) after the test."""
    started: list[HealthExec] = []

    def start(spec: TrainerSpec, **options: Any) -> HealthExec:
        rig = start_health_exec(tmp_path, spec, Env(s3_dest, local_s3.endpoint_url), **options)
        started.append(rig)
        return rig

    yield start
    for rig in started:
        rig.node.close()
