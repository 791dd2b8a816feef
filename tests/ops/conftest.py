"""Fixtures of the operations tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.readable_install import NotReadable, install_readable_ckptd


@pytest.fixture(scope="session")
def ckptd_for_other_users() -> Iterator[list[str]]:
    """The command that starts ckptd for a test running it as another uid: a copy that uid
    can read (this checkout may sit in a directory only root can read)."""
    root = Path(tempfile.mkdtemp(prefix="ckptd-for-others-"))
    try:
        root.chmod(0o755)
        try:
            command = install_readable_ckptd(root)
        except NotReadable as why:
            pytest.skip(f"runs ckptd as another uid, but {why}")
        yield command
    finally:
        shutil.rmtree(root, ignore_errors=True)
