"""A cloud destination without its optional dependency is one line naming the extra."""

from __future__ import annotations

import sys

import pytest

from ckptd.storage import StorageError, open_backend


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [
        ("gs://ckpt/x", "google.auth", "ckptd[gcs]"),
        ("az://ckpt/x", "azure.storage.blob", "ckptd[azure]"),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, url: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    with pytest.raises(StorageError) as err:
        open_backend(url, endpoint_url="http://127.0.0.1:1/devstoreaccount1")
    assert f"pip install '{extra}'" in str(err.value) and "\n" not in str(err.value)
    assert err.value.destination_unusable and not err.value.transient
