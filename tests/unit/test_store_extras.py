"""A missing optional extra is one line naming it by what any index has: its packages,
and how to reinstall ckptd with it from its checkout (ckptd itself is on no index)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from ckptd.core.extras import EXTRAS, install_hint
from ckptd.storage import StorageError, open_backend

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [
        ("gs://ckpt/x", "google.auth", "gcs"),
        ("az://ckpt/x", "azure.storage.blob", "azure"),
    ],
)
def test_a_missing_extra_is_one_line_naming_its_packages(
    monkeypatch: pytest.MonkeyPatch, url: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    with pytest.raises(StorageError) as err:
        open_backend(url, endpoint_url="http://127.0.0.1:1/devstoreaccount1")
    message = str(err.value)
    assert install_hint(extra) in message and "\n" not in message
    for package in EXTRAS[extra]:
        assert f"'{package}'" in message
    assert "pip install 'ckptd[" not in message  # no such package on any index
    assert err.value.destination_unusable and not err.value.transient


def test_the_hints_name_what_pyproject_installs_with_each_extra() -> None:
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for extra, packages in EXTRAS.items():
        assert tuple(declared[extra]) == packages, extra
