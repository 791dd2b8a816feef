"""What the contract suite cannot see for gs://: the requests on the wire (through a
recording proxy in front of fake-gcs-server), where the emulator checks less than GCS."""

from __future__ import annotations

import os
import uuid
from urllib.parse import parse_qs

import pytest
import requests

from ckptd.core import checksum
from ckptd.storage import PreconditionFailedError, StorageError, open_backend
from ckptd.storage.gcs import GCSStorage
from tests.support.emulators import FakeGCS
from tests.support.faultproxy import FaultProxy

KMS_KEY = "projects/p/locations/global/keyRings/r/cryptoKeys/ckptd"


def _query(record: object) -> dict[str, list[str]]:
    return parse_qs(getattr(record, "query", ""))


def test_the_commit_write_is_the_request_the_emulator_checks(fake_gcs: FakeGCS) -> None:
    """put_if_absent is a multipart upload carrying ifGenerationMatch=0 (and ckptd's
    CRC-32C); fake-gcs-server refuses the second one with 412, as GCS does. A media
    upload with the same precondition is accepted twice by the emulator: a test on that
    request form would prove nothing."""
    prefix = f"wire-{uuid.uuid4().hex[:8]}"
    with FaultProxy(fake_gcs.endpoint_url) as proxy:
        storage = open_backend(f"gs://ckpt/{prefix}", endpoint_url=proxy.url)
        body = b'{"manifest": 1}'
        storage.put_if_absent("run/c/m.json", body, crc32c=checksum.crc32c(body))
        with pytest.raises(PreconditionFailedError):
            storage.put_if_absent("run/c/m.json", b"other", crc32c=checksum.crc32c(b"other"))
        uploads = [r for r in proxy.requests if r.path.startswith("/upload/")]
        assert storage.get_bytes("run/c/m.json") == body
    assert [r.status for r in uploads] == [200, 412]
    for record in uploads:
        query = _query(record)
        assert query["uploadType"] == ["multipart"] and query["ifGenerationMatch"] == ["0"]
    # The form ckptd does not use, and why.
    media = f"{fake_gcs.endpoint_url}/upload/storage/v1/b/ckpt/o"
    params = {"uploadType": "media", "name": f"{prefix}/media", "ifGenerationMatch": "0"}
    codes = [requests.post(media, params=params, data=b"x", timeout=10).status_code for _ in "ab"]
    assert codes == [200, 200]


def test_a_customer_managed_key_is_carried_on_every_request_that_makes_an_object(
    fake_gcs: FakeGCS,
) -> None:
    prefix = f"kms-{uuid.uuid4().hex[:8]}"
    with FaultProxy(fake_gcs.endpoint_url) as proxy:
        storage = GCSStorage("ckpt", prefix, endpoint_url=proxy.url, kms_key_name=KMS_KEY)
        data = os.urandom(1000)
        storage.put_bytes("run/c/a", data, crc32c=checksum.crc32c(data))
        storage.put_if_absent("run/c/m", data, crc32c=checksum.crc32c(data))
        storage.copy("run/c/a", "run/d/a")
        upload_id = storage.create_upload("run/c/big")
        part = storage.upload_part("run/c/big", upload_id, 1, 0, data, crc32c=checksum.crc32c(data))
        storage.complete_upload("run/c/big", upload_id, [part])
        made = [
            r
            for r in proxy.requests
            if (r.method == "POST" and ("/upload/" in r.path or r.path.endswith(("/compose",))))
            or "/rewriteTo/" in r.path
        ]
    kinds = {("upload" if "/upload/" in r.path else r.path.rsplit("/", 1)[-1]) for r in made}
    assert {"upload", "compose"} <= kinds and any("/rewriteTo/" in r.path for r in made)
    for record in made:
        query = _query(record)
        key = query.get("kmsKeyName") or query.get("destinationKmsKeyName")
        assert key == [KMS_KEY], record


def test_no_google_credentials_is_one_line_and_marks_the_destination_unusable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/ckptd-key.json")
    storage = open_backend("gs://ckpt/x", endpoint_url="https://127.0.0.1:1")
    with pytest.raises(StorageError) as err:
        storage.check()
    assert err.value.destination_unusable and not err.value.transient
    assert err.value.code == "NoCredentials"
    assert "\n" not in str(err.value) and "GOOGLE_APPLICATION_CREDENTIALS" in str(err.value)


def test_a_missing_bucket_is_permanent_and_marks_the_destination_unusable(
    fake_gcs: FakeGCS,
) -> None:
    storage = open_backend("gs://no-such-bucket-ckptd/x", endpoint_url=fake_gcs.endpoint_url)
    with pytest.raises(StorageError) as err:
        storage.check()
    assert err.value.code == "NoSuchBucket" and err.value.destination_unusable
    with pytest.raises(StorageError) as err:
        storage.put_bytes("run/c/a", b"x", crc32c=checksum.crc32c(b"x"))
    assert err.value.destination_unusable and not err.value.transient


def test_more_parts_than_one_compose_takes_are_composed_in_a_tree(
    fake_gcs: FakeGCS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GCS composes at most 32 sources per request; scaled down to 2 here, 5 parts take
    three levels, and the result is the file, with the file's own CRC-32C, and nothing
    of the upload (parts or intermediates) is left."""
    import ckptd.storage.gcs as gcs

    monkeypatch.setattr(gcs, "_COMPOSE_MAX", 2)
    storage = GCSStorage("ckpt", f"tree-{uuid.uuid4().hex[:8]}", endpoint_url=fake_gcs.endpoint_url)
    chunks = [os.urandom(1000 + i) for i in range(5)]
    upload_id = storage.create_upload("run/c/big")
    parts = [
        storage.upload_part("run/c/big", upload_id, n, 0, c, crc32c=checksum.crc32c(c))
        for n, c in enumerate(chunks, start=1)
    ]
    info = storage.complete_upload("run/c/big", upload_id, parts)
    whole = b"".join(chunks)
    assert storage.get_bytes("run/c/big") == whole
    assert info.checksum == storage.expected_checksum(parts, checksum.crc32c(whole))
    assert storage.list_uploads("") == []
    leftovers = requests.get(
        f"{fake_gcs.endpoint_url}/storage/v1/b/ckpt/o",
        params={"prefix": f"{storage.prefix}/.ckptd-uploads/"},
        timeout=10,
    ).json()
    assert leftovers.get("items", []) == []
