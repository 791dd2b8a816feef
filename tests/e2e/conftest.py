"""Every test under tests/e2e carries the marker ``e2e``: ``make test`` runs them in its
second pytest, beside the rest of the suite (Makefile, ``BESIDE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)
