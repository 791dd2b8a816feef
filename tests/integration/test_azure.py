"""What the contract suite cannot see for az://: the requests on the wire (through a
recording proxy in front of Azurite), and the credential chain's failure."""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import pytest

from ckptd.core import checksum
from ckptd.storage import PreconditionFailedError, StorageError, open_backend
from ckptd.storage.azure import AzureBlobStorage
from tests.support.emulators import Azurite
from tests.support.faultproxy import FaultProxy


def test_the_commit_write_is_put_blob_with_if_none_match_and_azurite_checks_it(
    azurite: Azurite,
) -> None:
    prefix = f"wire-{uuid.uuid4().hex[:8]}"
    with FaultProxy(azurite.endpoint_url.rsplit("/", 1)[0]) as proxy:
        storage = open_backend(f"az://ckpt/{prefix}", endpoint_url=f"{proxy.url}/devstoreaccount1")
        body = b'{"manifest": 1}'
        storage.put_if_absent("run/c/m.json", body, crc32c=checksum.crc32c(body))
        with pytest.raises(PreconditionFailedError):
            storage.put_if_absent("run/c/m.json", b"other", crc32c=checksum.crc32c(b"other"))
        puts = [r for r in proxy.requests if r.method == "PUT"]
        assert storage.get_bytes("run/c/m.json") == body
    assert [r.status for r in puts] == [201, 409]
    for record in puts:
        assert record.header("if-none-match") == "*"
        assert record.header("x-ms-blob-type") == "BlockBlob"
        assert record.header("content-md5")  # Azure checks the body against it


def test_an_encryption_scope_is_carried_on_every_request_that_writes(azurite: Azurite) -> None:
    prefix = f"scope-{uuid.uuid4().hex[:8]}"
    with FaultProxy(azurite.endpoint_url.rsplit("/", 1)[0]) as proxy:
        storage = AzureBlobStorage(
            "ckpt",
            prefix,
            endpoint_url=f"{proxy.url}/devstoreaccount1",
            encryption_scope="ckptd-scope",
        )
        data = os.urandom(1000)
        crc = checksum.crc32c(data)
        for put in (storage.put_bytes, storage.put_if_absent):
            # Azurite may refuse a scope it does not know; the request is what counts.
            with contextlib.suppress(StorageError):
                put("run/c/a", data, crc32c=crc)
        upload_id = storage.create_upload("run/c/big")
        with contextlib.suppress(StorageError):
            part = storage.upload_part("run/c/big", upload_id, 1, 0, data, crc32c=crc)
            storage.complete_upload("run/c/big", upload_id, [part])
        storage.copy("run/c/a", "run/d/a")
        assert storage.get_bytes("run/d/a") == data
        writes = [r for r in proxy.requests if r.method == "PUT"]
    kinds = {r.query.split("&")[0] for r in writes}
    assert {"", "comp=block", "comp=blocklist"} <= kinds
    assert any(r.header("x-ms-copy-source") and r.header("x-ms-requires-sync") for r in writes)
    assert all(r.header("x-ms-encryption-scope") == "ckptd-scope" for r in writes)


def test_no_azure_credential_is_one_line_and_marks_the_destination_unusable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith(("AZURE_", "IDENTITY_", "MSI_")):
            monkeypatch.delenv(name)
    storage = open_backend("az://ckpt/x", endpoint_url="https://127.0.0.1:1/ckptdtest")
    started = time.monotonic()
    with pytest.raises(StorageError) as err:
        storage.check()
    assert err.value.destination_unusable and not err.value.transient, err.value
    assert err.value.code == "NoCredentials" and "\n" not in str(err.value)
    assert time.monotonic() - started < 120


def test_no_account_is_one_line_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_CONNECTION_STRING"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StorageError) as err:
        open_backend("az://ckpt/x")
    assert err.value.destination_unusable and "endpoint_url" in str(err.value)


def test_a_copy_beyond_one_sync_copy_is_put_block_from_url_per_range(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Azurite does not implement Put Block From URL (it answers 501), so this checks the
    requests: one per block, each naming the source with a read-only SAS and its range,
    carrying the encryption scope. The limits are scaled down (2 MiB, 1 MiB blocks)."""
    import ckptd.storage.azure as azure

    monkeypatch.setattr(azure, "COPY_WHOLE_MAX", 2 * 1024 * 1024)
    monkeypatch.setattr(azure, "COPY_BLOCK", 1024 * 1024)
    data = os.urandom(2 * 1024 * 1024 + 10)
    with FaultProxy(azurite.endpoint_url.rsplit("/", 1)[0]) as proxy:
        storage = AzureBlobStorage(
            "ckpt",
            f"big-{uuid.uuid4().hex[:8]}",
            endpoint_url=f"{proxy.url}/devstoreaccount1",
            encryption_scope="ckptd-scope",
        )
        storage.put_bytes("run/c/a", data, crc32c=checksum.crc32c(data))
        with pytest.raises(StorageError):  # 501 from Azurite at the first block
            storage.copy("run/c/a", "run/d/a")
        sent = [r for r in proxy.requests if r.header("x-ms-copy-source")]
    assert sent and sent[0].query.startswith("comp=block")
    first = sent[0]
    assert first.header("x-ms-source-range") == "bytes=0-1048575"
    assert "sp=r" in (first.header("x-ms-copy-source") or "")
    assert first.header("x-ms-encryption-scope") == "ckptd-scope"
