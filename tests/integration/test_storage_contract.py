"""One contract, every backend: SeaweedFS S3, moto's S3 server (a second dialect),
fake-gcs-server (gs://), Azurite (az://) and a real directory (file://). What one backend promises, all keep."""

from __future__ import annotations

import ast
import asyncio
import errno
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import pytest
from pydantic import ValidationError

from ckptd.config import DestinationConfig
from ckptd.core import checksum
from ckptd.devtools.locals3 import LocalS3
from ckptd.layouts.base import FileEntry
from ckptd.storage import (
    ConditionalWrite,
    LimitedStorage,
    MultipartUpload,
    NotFoundError,
    PartListing,
    PreconditionFailedError,
    RateLimiter,
    RetryingStorage,
    ServerSideCopy,
    ShortObjectError,
    Storage,
    StorageError,
    StorageWrapper,
    StoreChecksums,
    capability,
    open_backend,
    open_destination,
    open_storage,
    require_capability,
)
from ckptd.storage.base import STREAM_PIECE
from ckptd.storage.fs import FileStorage
from ckptd.storage.s3 import S3Storage
from ckptd.sync.journal import Journal
from ckptd.sync.transfer import FileResult, TransferContext, TransferPausedError, Transfers
from tests.support.emulators import Azurite, FakeGCS
from tests.support.faultproxy import FaultProxy

MiB = 1024 * 1024
T = TypeVar("T")


@dataclass(frozen=True)
class Destination:
    backend: str  # the fixture's param: "seaweedfs", "moto", "gcs", "azure", "file", ...
    url: str
    endpoint_url: str = ""


#: A tmpfs, another filesystem than the tests' files: what a shared NFS/Lustre/NVMe mount
#: is to a node's local disk (copy_file_range refuses it with EXDEV).
OTHER_FILESYSTEM = Path("/dev/shm")


@pytest.fixture(params=["seaweedfs", "moto", "gcs", "azure", "file", "file-other-fs"])
def destination(request: pytest.FixtureRequest, tmp_path: Path) -> Destination:
    prefix = f"contract-{uuid.uuid4().hex[:8]}"
    if request.param == "seaweedfs":
        local_s3: LocalS3 = request.getfixturevalue("local_s3")
        return Destination(request.param, f"s3://ckpt/{prefix}", local_s3.endpoint_url)
    if request.param == "moto":
        endpoint: str = request.getfixturevalue("moto_endpoint")
        return Destination(request.param, f"s3://ckpt/{prefix}", endpoint)
    if request.param == "gcs":
        fake_gcs: FakeGCS = request.getfixturevalue("fake_gcs")
        return Destination(request.param, f"gs://ckpt/{prefix}", fake_gcs.endpoint_url)
    if request.param == "azure":
        azurite: Azurite = request.getfixturevalue("azurite")
        return Destination(request.param, f"az://ckpt/{prefix}", azurite.endpoint_url)
    if request.param == "file-other-fs":
        if (
            not OTHER_FILESYSTEM.is_dir()
            or OTHER_FILESYSTEM.stat().st_dev == tmp_path.stat().st_dev
        ):
            pytest.skip(f"{OTHER_FILESYSTEM} is not another filesystem than {tmp_path} here")
        root = Path(tempfile.mkdtemp(prefix="ckptd-contract-", dir=OTHER_FILESYSTEM))
        request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
        return Destination(request.param, f"file://{root / 'dest'}")
    return Destination(request.param, f"file://{tmp_path / 'dest'}")


@pytest.fixture
def storage(destination: Destination) -> Storage:
    return open_backend(destination.url, endpoint_url=destination.endpoint_url)


def _put(storage: Storage, key: str, data: bytes) -> None:
    storage.put_bytes(key, data, crc32c=checksum.crc32c(data))


def test_put_get_head_roundtrip(storage: Storage) -> None:
    data = os.urandom(1000)
    _put(storage, "run/ckpt-1/a.bin", data)
    assert storage.get_bytes("run/ckpt-1/a.bin") == data
    info = storage.head("run/ckpt-1/a.bin")
    assert info is not None and info.size == 1000
    pieces: list[bytes] = []
    storage.stream_range("run/ckpt-1/a.bin", 10, 20, lambda pos, b: pieces.append(b))
    assert b"".join(pieces) == data[10:30]


def test_head_says_when_the_store_wrote_the_object_by_its_own_clock(storage: Storage) -> None:
    """What ``ckptd doctor`` measures clock skew against. Every store here runs on this
    machine, so its clock is this clock (to its 1 s resolution, plus a slow request)."""
    before = time.time()
    _put(storage, "run/when.bin", b"x")
    after = time.time()
    info = storage.head("run/when.bin")
    assert info is not None and before - 2 <= info.modified <= after + 2, (before, info)


def test_a_streamed_range_arrives_in_order_in_bounded_pieces(storage: Storage) -> None:
    data = os.urandom(2 * STREAM_PIECE + 12345)
    _put(storage, "run/ckpt-1/big.bin", data)
    pieces: list[tuple[int, bytes]] = []
    start, length = 1000, 2 * STREAM_PIECE + 5000
    storage.stream_range(
        "run/ckpt-1/big.bin", start, length, lambda pos, b: pieces.append((pos, b))
    )
    assert all(len(b) <= STREAM_PIECE for _, b in pieces)
    assert [pos for pos, _ in pieces] == [
        sum(len(b) for _, b in pieces[:i]) for i in range(len(pieces))
    ]
    assert b"".join(b for _, b in pieces) == data[start : start + length]


def test_a_range_past_the_end_of_the_object_is_an_error(storage: Storage) -> None:
    _put(storage, "run/ckpt-1/small.bin", b"x" * 100)
    with pytest.raises(ShortObjectError):
        storage.stream_range("run/ckpt-1/small.bin", 50, 100, lambda pos, b: None)


def test_missing_key_is_none_on_head_and_not_found_on_get(storage: Storage) -> None:
    assert storage.head("run/none") is None
    with pytest.raises(NotFoundError):
        storage.get_bytes("run/none")


def test_conditional_write_loses_to_an_existing_key_and_keeps_it(storage: Storage) -> None:
    first, second = b"first", b"second"
    storage.put_if_absent("run/ckpt/m.json", first, crc32c=checksum.crc32c(first))
    with pytest.raises(PreconditionFailedError):
        storage.put_if_absent("run/ckpt/m.json", second, crc32c=checksum.crc32c(second))
    assert storage.get_bytes("run/ckpt/m.json") == first


def test_listing_is_recursive_and_children_are_direct(storage: Storage) -> None:
    for key in ("run/c-1/a", "run/c-1/sub/b", "run/c-2/a", "other/c-9/a"):
        _put(storage, key, b"x")
    keys = sorted(o.key for o in storage.list_objects("run/"))
    assert keys == ["run/c-1/a", "run/c-1/sub/b", "run/c-2/a"]
    assert sorted(storage.list_children("run/")) == ["c-1", "c-2"]
    assert sorted(storage.list_children("")) == ["other", "run"]


def test_delete_removes_keys_and_ignores_missing_ones(storage: Storage) -> None:
    _put(storage, "run/c/a", b"1")
    _put(storage, "run/c/b", b"2")
    storage.delete(["run/c/a", "run/c/missing"])
    assert [o.key for o in storage.list_objects("run/")] == ["run/c/b"]


def test_server_side_copy_is_identical(storage: Storage) -> None:
    data = os.urandom(3 * MiB)
    _put(storage, "run/c-1/base.bin", data)
    copied = storage.copy("run/c-1/base.bin", "run/c-2/base.bin")
    assert copied.size == len(data)
    assert storage.get_bytes("run/c-2/base.bin") == data
    source = storage.head("run/c-1/base.bin")
    assert source is not None and copied.checksum == source.checksum


def test_multipart_upload_assembles_parts_and_reports_its_checksum(storage: Storage) -> None:
    parts_data = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(12345)]
    key = "run/c/big.bin"
    upload_id = storage.create_upload(key)
    assert (key, upload_id) in storage.list_uploads("run/")
    parts = []
    offset = 0
    for number, data in enumerate(parts_data, start=1):
        parts.append(
            storage.upload_part(key, upload_id, number, offset, data, crc32c=checksum.crc32c(data))
        )
        offset += len(data)
    lister = capability(storage, PartListing)
    held = lister.list_parts(key, upload_id) if lister is not None else None
    assert held is None or sorted(held) == [1, 2, 3]
    storage.complete_upload(key, upload_id, parts)
    whole = b"".join(parts_data)
    assert storage.get_bytes(key) == whole
    info = storage.head(key)
    assert info is not None and info.size == len(whole)
    sums = capability(storage, StoreChecksums)
    expected = sums.expected_checksum(parts, checksum.crc32c(whole)) if sums else ""
    if expected and info.checksum:
        assert checksum.s3_checksums_match(info.checksum, expected)
    assert storage.list_uploads("run/") == []
    # Folding part CRCs gives the whole-file value the manifest records.
    assert checksum.combine_parts((p.crc32c, p.size) for p in parts) == checksum.crc32c(whole)


def test_aborted_upload_leaves_nothing(storage: Storage) -> None:
    key = "run/c/aborted.bin"
    upload_id = storage.create_upload(key)
    data = os.urandom(5 * MiB)
    storage.upload_part(key, upload_id, 1, 0, data, crc32c=checksum.crc32c(data))
    storage.abort_upload(key, upload_id)
    storage.abort_upload(key, upload_id)  # idempotent
    assert storage.head(key) is None
    assert storage.list_uploads("run/") == []
    assert list(storage.list_objects("run/")) == []


def test_a_body_that_does_not_match_its_crc_is_refused_and_nothing_is_written(
    storage: Storage, request: pytest.FixtureRequest
) -> None:
    if "moto" in request.node.name:
        pytest.skip("moto does not validate checksums (the reason SeaweedFS is the main S3)")
    data = os.urandom(4096)
    with pytest.raises(StorageError) as err:
        storage.put_bytes("run/c/bad.bin", data, crc32c=checksum.crc32c(data) ^ 1)
    assert err.value.code in ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch")
    assert storage.head("run/c/bad.bin") is None


def test_check_passes_on_a_usable_destination(storage: Storage) -> None:
    storage.check()


def test_missing_bucket_is_a_permanent_error(local_s3: LocalS3) -> None:
    storage = open_backend("s3://no-such-bucket-contract/x", endpoint_url=local_s3.endpoint_url)
    with pytest.raises(StorageError) as err:
        storage.check()
    assert err.value.code == "NoSuchBucket" and not err.value.transient


def test_the_url_parser_imports_nothing_that_does_io() -> None:
    # Configuration imports it: it must stay a pure function of the string.
    import ckptd.core.url

    tree = ast.parse(Path(ckptd.core.url.__file__).read_text())
    imported = {
        name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
    }
    assert imported <= {
        "__future__",
        "ipaddress",
        "re",
        "dataclasses",
        "pathlib",
        "typing",
        "urllib",
    }


# -- one way to open storage from configuration -------------------------------------------


def test_open_destination_caps_uploads_only_where_asked(tmp_path: Path) -> None:
    dest = DestinationConfig(
        url=f"file://{tmp_path / 'dest'}", max_upload_mib_per_s=2.5, max_attempts=3
    )
    daemon = open_destination(dest, limit_uploads=True)  # as the service opens it
    command = open_destination(dest)  # as the CLI's commands do
    for stack, rate in ((daemon, 2.5 * MiB), (command, 0)):
        assert stack.max_attempts == 3 and stack.url == open_backend(dest.url).url
        assert isinstance(stack.inner, LimitedStorage) and stack.inner.limiter.rate == rate


def test_open_destination_sizes_the_connection_pool_for_a_concurrency_override() -> None:
    dest = DestinationConfig(url="s3://ckpt/x", endpoint_url="http://127.0.0.1:1", concurrency=3)
    # The large files' threads, the small files' lanes (4 per unit) and 4 more.
    for override, connections in ((None, 3 + 12 + 4), (20, 20 + 80 + 4)):  # restore's --concurrency
        backend = open_destination(dest, concurrency=override).inner.inner
        assert isinstance(backend, S3Storage)
        assert backend._client.meta.config.max_pool_connections == connections


# -- permanence decided by the backend that saw the error ---------------------------------


def test_a_missing_bucket_marks_the_destination_unusable_on_any_operation(
    local_s3: LocalS3,
) -> None:
    # Reads only: SeaweedFS creates a missing bucket on a PUT.
    storage = open_backend("s3://no-such-bucket-unusable/x", endpoint_url=local_s3.endpoint_url)
    with pytest.raises(StorageError) as checked:
        storage.check()
    with pytest.raises(StorageError) as got:
        storage.get_bytes("run/c/a")
    for err in (checked.value, got.value):
        assert err.code == "NoSuchBucket", err
        assert err.destination_unusable and not err.transient, err


def test_a_denied_request_marks_the_destination_unusable(fault_proxy: FaultProxy) -> None:
    fault_proxy.deny("403-accessdenied", methods={"PUT"})
    storage = open_backend(f"s3://ckpt/{uuid.uuid4().hex[:8]}", endpoint_url=fault_proxy.url)
    with pytest.raises(StorageError) as err:
        _put(storage, "run/c/a", b"x")
    assert err.value.code == "AccessDenied" and err.value.destination_unusable


def test_a_transient_s3_error_leaves_the_destination_usable(fault_proxy: FaultProxy) -> None:
    fault_proxy.fail_next(1, "503-slowdown", methods={"PUT"})
    storage = open_backend(f"s3://ckpt/{uuid.uuid4().hex[:8]}", endpoint_url=fault_proxy.url)
    with pytest.raises(StorageError) as err:
        _put(storage, "run/c/a", b"x")
    assert err.value.transient and not err.value.destination_unusable
    _put(storage, "run/c/a", b"x")  # the next attempt goes through: usable indeed


def test_a_root_that_cannot_be_made_marks_the_destination_unusable(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    storage = open_backend(f"file://{tmp_path / 'a-file' / 'dest'}")
    with pytest.raises(StorageError) as err:
        storage.check()
    assert err.value.destination_unusable and not err.value.transient
    assert err.value.code == "ENOTDIR"


@pytest.mark.skipif(os.geteuid() == 0, reason="root is never refused a write")
def test_a_root_this_node_may_not_write_marks_the_destination_unusable(tmp_path: Path) -> None:
    root = tmp_path / "dest"
    root.mkdir(mode=0o500)
    storage = open_backend(f"file://{root}")
    try:
        for operation in (storage.check, lambda: _put(storage, "run/c/a", b"x")):
            with pytest.raises(StorageError) as err:
                operation()
            assert err.value.code == "EACCES" and err.value.destination_unusable
    finally:
        root.chmod(0o700)


def test_a_transient_filesystem_error_leaves_the_destination_usable(tmp_path: Path) -> None:
    # An I/O error on one file (a flaky NFS server, say) is worth retrying; it says
    # nothing about the destination as a whole.
    from ckptd.storage.fs import _error

    err = _error(OSError(errno.EIO, os.strerror(errno.EIO)), "put run/c/a")
    assert err.transient and not err.destination_unusable


def test_the_pipeline_marks_the_destination_down_by_the_backend_flag_alone(
    tmp_path: Path,
) -> None:
    from ckptd.config import Settings
    from ckptd.runtime.metrics import Metrics
    from ckptd.sync.journal import Journal
    from ckptd.sync.pipeline import SyncPipeline
    from ckptd.sync.queue import Pending
    from ckptd.sync.ship import Outcome, ShipResult

    settings = Settings.model_validate(
        {"destination": {"url": f"file://{tmp_path / 'dest'}"}, "watch": [{"dir": tmp_path}]}
    )
    metrics = Metrics()
    journal = Journal(tmp_path / "state")
    pipeline = SyncPipeline(settings, open_backend(settings.destination.url), journal, metrics)
    try:
        (state,) = pipeline.runs.values()
        metrics.destination_up.set(1)

        def up() -> float | None:
            return metrics.registry.get_sample_value("ckptd_destination_up")

        # An S3 code that used to mean "down", without the backend's flag: still up.
        denied_key = StorageError("get run/c/a: AccessDenied", transient=False, code="AccessDenied")
        failed = ShipResult(Outcome.FAILED, error=denied_key)
        asyncio.run(
            pipeline.outcomes.failed(
                state, Pending(state.run_id, "c", 1, 0.0), failed, pipeline.log
            )
        )
        assert up() == 1
        # A filesystem refusal the backend flagged: down.
        refused = StorageError(
            "put run/c/a: EACCES", transient=False, code="EACCES", destination_unusable=True
        )
        failed = ShipResult(Outcome.FAILED, error=refused)
        asyncio.run(
            pipeline.outcomes.failed(
                state, Pending(state.run_id, "c", 1, 0.0), failed, pipeline.log
            )
        )
        assert up() == 0
    finally:
        pipeline.transfers.close()
        journal.close()


@pytest.mark.parametrize("key", ["../escape", "run/../../escape", "/abs", "run//x", "run/./x"])
def test_file_backend_refuses_keys_that_leave_its_root(tmp_path: Path, key: str) -> None:
    storage = open_backend(f"file://{tmp_path / 'dest'}")
    with pytest.raises(StorageError):
        storage.put_bytes(key, b"x", crc32c=checksum.crc32c(b"x"))
    assert not (tmp_path / "escape").exists()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_parts_streamed_from_a_file_range_assemble_identically(
    storage: Storage, tmp_path: Path
) -> None:
    from ckptd.storage.base import FileRange

    data = os.urandom(11 * MiB + 7)
    local = tmp_path / "big.bin"
    local.write_bytes(data)
    key = "run/c/streamed.bin"
    upload_id = storage.create_upload(key)
    fd = os.open(local, os.O_RDONLY)
    try:
        parts = []
        for number, start in enumerate(range(0, len(data), 5 * MiB), start=1):
            chunk = data[start : start + 5 * MiB]
            body = FileRange(fd, start, len(chunk))
            parts.append(
                storage.upload_part(
                    key, upload_id, number, start, body, crc32c=checksum.crc32c(chunk)
                )
            )
    finally:
        os.close(fd)
    storage.complete_upload(key, upload_id, parts)
    assert storage.get_bytes(key) == data


# -- one URL parser ----------------------------------------------------------------------


def test_config_and_open_backend_read_a_file_url_as_the_same_root(tmp_path: Path) -> None:
    root = tmp_path / "shared ckpt%41"  # a space and a literal '%' in the directory name
    url = f"file://{quote(str(root))}"
    backend = open_backend(url)
    assert isinstance(backend, FileStorage)
    assert DestinationConfig(url=url).root_path == root
    assert backend.root == root.resolve()


def test_config_and_open_backend_read_an_s3_url_as_the_same_bucket_and_prefix() -> None:
    url = "s3://ckpt/team/run-a/"
    backend = open_backend(url, endpoint_url="http://127.0.0.1:1")
    dest = DestinationConfig(url=url)
    assert isinstance(backend, S3Storage)
    assert (backend.bucket, backend.prefix) == (dest.bucket, dest.prefix) == ("ckpt", "team/run-a")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("s3://192.168.1.1/x", "bucket name must not be an IP address"),
        ("s3://ckpt/a/../b", "prefix must not contain empty, '.' or '..' segments"),
        ("file://host/path", "must be file:///absolute/path (three slashes, no host)"),
        (
            "ftp://bucket",
            "must be s3://bucket[/prefix], gs://bucket[/prefix], az://container[/prefix] "
            "or file:///absolute/path",
        ),
        ("gs://Bucket/x", "must be gs://bucket[/prefix] with a bucket name of 3-63"),
        ("az://a--b/x", "must be az://container[/prefix] with a container name of 3-63"),
    ],
)
def test_config_and_open_backend_refuse_a_malformed_url_for_the_same_reason(
    url: str, problem: str
) -> None:
    with pytest.raises(ValidationError, match=re.escape(problem)):
        DestinationConfig(url=url)
    with pytest.raises(ValueError, match=re.escape(problem)):
        open_backend(url)


# -- capabilities: declared by each backend, kept through every wrapper ---------------------

CAPABILITIES: tuple[type, ...] = (
    ConditionalWrite,
    ServerSideCopy,
    MultipartUpload,
    PartListing,
    StoreChecksums,
)
# What each store can promise. A directory cannot tell which parts of an upload it holds
# (they are ranges of one temporary file) and reports no checksum of its own.
DECLARED = {
    "seaweedfs": set(CAPABILITIES),
    "moto": set(CAPABILITIES),
    "gcs": set(CAPABILITIES),
    # Azure keeps no checksum of a blob made of blocks, and none in CRC-32C.
    "azure": {ConditionalWrite, ServerSideCopy, MultipartUpload, PartListing},
    "file": {ConditionalWrite, ServerSideCopy, MultipartUpload},
    "file-other-fs": {ConditionalWrite, ServerSideCopy, MultipartUpload},
}


def _capabilities(storage: object) -> set[type]:
    return {kind for kind in CAPABILITIES if isinstance(storage, kind)}


def test_each_backend_declares_the_capabilities_its_store_keeps(
    destination: Destination, storage: Storage
) -> None:
    assert isinstance(storage, Storage)
    assert _capabilities(storage) == DECLARED[destination.backend]


def test_a_wrapper_stack_has_exactly_its_backends_capabilities(
    destination: Destination, storage: Storage
) -> None:
    stack = open_storage(destination.url, endpoint_url=destination.endpoint_url)
    assert isinstance(stack.inner, LimitedStorage)  # the stack is two wrappers deep
    assert isinstance(stack, Storage)
    assert _capabilities(stack) == _capabilities(stack.inner) == _capabilities(storage)
    for kind in CAPABILITIES:
        # A capability is used through the stack (retried, rate-limited), never around it.
        assert capability(stack, kind) is (stack if kind in DECLARED[destination.backend] else None)


class _FailsEachOperationOnce(StorageWrapper):
    """Fails the first attempt of every operation with a transient error."""

    def _run(self, operation: str, fn: Callable[[], T], *, sends: int | None = None) -> T:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % 2:
            raise StorageError(f"{operation}: injected", transient=True, code="SlowDown")
        return fn()


def test_every_operation_is_retried_under_its_own_name(
    destination: Destination, storage: Storage
) -> None:
    retried: list[str] = []
    stack = RetryingStorage(
        _FailsEachOperationOnce(storage),
        base_delay=0,
        on_retry=lambda operation, exc, attempt, delay: retried.append(operation),
    )
    data = os.urandom(5 * MiB)
    crc = checksum.crc32c(data)
    stack.put_bytes("run/c/a", b"a", crc32c=checksum.crc32c(b"a"))
    stack.get_bytes("run/c/a")
    stack.stream_range("run/c/a", 0, 1, lambda pos, b: None)
    stack.head("run/c/a")
    list(stack.list_objects("run/"))
    stack.list_children("run/")
    stack.check()
    expected = ["put", "get", "get", "head", "list", "list", "check"]
    if (conditional := capability(stack, ConditionalWrite)) is not None:
        conditional.put_if_absent("run/c/m", b"m", crc32c=checksum.crc32c(b"m"))
        expected.append("put_if_absent")
    if (copier := capability(stack, ServerSideCopy)) is not None:
        copier.copy("run/c/a", "run/d/a")
        expected.append("copy")
    if (uploads := capability(stack, MultipartUpload)) is not None:
        upload_id = uploads.create_upload("run/c/big")
        part = uploads.upload_part("run/c/big", upload_id, 1, 0, data, crc32c=crc)
        expected += ["create_upload", "upload_part"]
        if (lister := capability(stack, PartListing)) is not None:
            assert list(lister.list_parts("run/c/big", upload_id)) == [1]
            expected.append("list_parts")
        assert uploads.list_uploads("run/") == [("run/c/big", upload_id)]
        uploads.complete_upload("run/c/big", upload_id, [part])
        uploads.abort_upload("run/c/big", upload_id)
        expected += ["list_uploads", "complete_upload", "abort_upload"]
    stack.delete(["run/c/a"])
    expected.append("delete")
    assert retried == expected
    assert stack.get_bytes("run/c/big") == data


class _RecordingLimiter(RateLimiter):
    def __init__(self) -> None:
        super().__init__(0)
        self.charged: list[int] = []

    def acquire(self, nbytes: int) -> None:
        self.charged.append(nbytes)


def test_the_bandwidth_cap_charges_exactly_the_bytes_uploaded(storage: Storage) -> None:
    limiter = _RecordingLimiter()
    stack = LimitedStorage(storage, limiter)
    data = os.urandom(5 * MiB)
    stack.put_bytes("run/c/a", b"abc", crc32c=checksum.crc32c(b"abc"))
    stack.get_bytes("run/c/a")
    list(stack.list_objects("run/"))
    conditional = require_capability(stack, ConditionalWrite, "commit")
    conditional.put_if_absent("run/c/m", b"12345", crc32c=checksum.crc32c(b"12345"))
    uploads = require_capability(stack, MultipartUpload, "upload")
    upload_id = uploads.create_upload("run/c/big")
    uploads.upload_part("run/c/big", upload_id, 1, 0, data, crc32c=checksum.crc32c(data))
    uploads.abort_upload("run/c/big", upload_id)
    assert limiter.charged == [3, 5, len(data)]


class _NoConditionalWrite(FileStorage):
    # None blocks a protocol method for isinstance: this directory cannot write
    # conditionally (as an NFS server without atomic link() could not).
    put_if_absent = None  # type: ignore[assignment]


def test_commit_refuses_a_destination_without_conditional_write(tmp_path: Path) -> None:
    from ckptd.commit.single import commit
    from ckptd.core.manifest import build_manifest

    stack = RetryingStorage(_NoConditionalWrite(tmp_path / "dest"))
    assert capability(stack, ConditionalWrite) is None
    manifest = build_manifest(
        run_id="run",
        checkpoint="checkpoint-5",
        step=5,
        layout="hf",
        host="node",
        created_at=0,
        committed_at=1,
        files=[],
        environment={},
    )
    with pytest.raises(StorageError) as err:
        commit(stack, manifest)
    assert not err.value.transient and err.value.destination_unusable
    assert err.value.code == "Unsupported"
    assert stack.url in str(err.value) and "ConditionalWrite" in str(err.value)
    assert list(stack.list_objects("")) == []  # no LATEST without a manifest


# -- resuming a multipart upload, with and without the store's part listing ----------------


def _model_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A local file of three 5 MiB parts, the last one short."""
    local = tmp_path / "ckpt" / "model.bin"
    local.parent.mkdir()
    data = os.urandom(10 * MiB + 12345)
    local.write_bytes(data)
    return local, data


async def _upload_again(
    stack: Storage, journal: Journal, local: Path, key: str, entry: FileEntry
) -> FileResult:
    """Upload ``local`` with a fresh Transfers, as a restarted daemon does."""
    second = Transfers(stack, journal, part_size=5 * MiB, concurrency=2)
    try:
        return await second.upload(key, local, entry, TransferContext("run", "ckpt"))
    finally:
        second.close()


async def _interrupted_upload(
    stack: Storage, journal: Journal, local: Path, key: str
) -> tuple[FileEntry, str]:
    """Send two of the three parts of ``local`` to ``key`` and stop, as a pause does."""
    st = local.stat()
    entry = FileEntry(local.name, st.st_size, st.st_mtime_ns)
    ctx = TransferContext("run", "ckpt")
    sent: list[int] = []

    def on_bytes(run: str, n: int) -> None:
        sent.append(n)
        if len(sent) == 2:
            ctx.pause.set()

    # One worker: parts go in order, so the pause lands after exactly parts 1 and 2.
    first = Transfers(stack, journal, part_size=5 * MiB, concurrency=1, on_bytes=on_bytes)
    try:
        with pytest.raises(TransferPausedError):
            await first.upload(key, local, entry, ctx)
    finally:
        first.close()
    rec = journal.upload_for(key)
    assert rec is not None and rec.upload_id is not None
    assert sorted(journal.parts_for(rec.upload_id)) == [1, 2]
    return entry, rec.upload_id


async def test_an_interrupted_upload_resumes_with_only_the_parts_not_journalled(
    destination: Destination, tmp_path: Path
) -> None:
    stack = open_storage(destination.url, endpoint_url=destination.endpoint_url)
    # A directory cannot list parts: there the journal alone says what is sent.
    assert (capability(stack, PartListing) is None) == destination.backend.startswith("file")
    local, data = _model_file(tmp_path)
    journal = Journal(tmp_path / "state")
    key = "run/ckpt/model.bin"
    try:
        entry, _ = await _interrupted_upload(stack, journal, local, key)
        result = await _upload_again(stack, journal, local, key, entry)
        assert (result.how, result.bytes_sent) == ("resumed", 12345)
        assert journal.upload_for(key) is None
    finally:
        journal.close()
    assert stack.get_bytes(key) == data


async def test_an_upload_gone_from_the_store_starts_again_from_the_first_part(
    destination: Destination, tmp_path: Path
) -> None:
    stack = open_storage(destination.url, endpoint_url=destination.endpoint_url)
    local, data = _model_file(tmp_path)
    journal = Journal(tmp_path / "state")
    key = "run/ckpt/model.bin"
    try:
        entry, upload_id = await _interrupted_upload(stack, journal, local, key)
        # Gone behind the journal's back (a lifecycle rule, an operator's cleanup).
        require_capability(stack, MultipartUpload, "abort").abort_upload(key, upload_id)
        result = await _upload_again(stack, journal, local, key, entry)
        assert (result.how, result.bytes_sent) == ("uploaded", len(data))
    finally:
        journal.close()
    assert stack.get_bytes(key) == data


def test_the_part_size_grows_only_where_10000_parts_would_not_hold_a_file() -> None:
    from ckptd.sync.transfer import MAX_PARTS, part_size_for

    assert MAX_PARTS == 10_000  # S3's limit (UploadPart: PartNumber 1..10,000)
    assert part_size_for(5 * MiB, 64 * MiB) == 64 * MiB
    assert part_size_for(10_000 * 64 * MiB, 64 * MiB) == 64 * MiB  # fits exactly
    # A 700 GiB file (a 175B model's fp32 shard) at 64 MiB would need 11,200 parts.
    size = 700 * 1024 * MiB
    part = part_size_for(size, 64 * MiB)
    assert part % MiB == 0 and -(-size // part) <= MAX_PARTS
    assert part - MiB < -(-size // MAX_PARTS)  # the smallest whole MiB that fits


async def test_a_file_beyond_max_parts_goes_in_fewer_larger_parts_and_resumes(
    destination: Destination, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit scaled down (4 parts) so a 30 MiB file stands for a file beyond 10,000
    parts: it goes in 4 parts of 8 MiB, not 6 of 5 MiB, and a restart with its part
    record resumes it with the same part size."""
    import ckptd.sync.transfer as transfer

    monkeypatch.setattr(transfer, "MAX_PARTS", 4)
    stack = open_storage(destination.url, endpoint_url=destination.endpoint_url)
    local = tmp_path / "big.bin"
    data = os.urandom(30 * MiB)
    local.write_bytes(data)
    st = local.stat()
    entry = FileEntry(local.name, st.st_size, st.st_mtime_ns)
    journal = Journal(tmp_path / "state")
    key = "run/ckpt/big.bin"
    ctx = TransferContext("run", "ckpt")
    sent: list[int] = []

    def on_bytes(run: str, n: int) -> None:
        sent.append(n)
        if len(sent) == 2:
            ctx.pause.set()  # one worker: parts go in order, so this lands after part 2

    try:
        first = Transfers(stack, journal, part_size=5 * MiB, concurrency=1, on_bytes=on_bytes)
        try:
            with pytest.raises(TransferPausedError):
                await first.upload(key, local, entry, ctx)
        finally:
            first.close()
        assert sent == [8 * MiB, 8 * MiB]
        result = await _upload_again(stack, journal, local, key, entry)
    finally:
        journal.close()
    assert [p.size for p in result.parts] == [8 * MiB, 8 * MiB, 8 * MiB, 6 * MiB]
    assert (result.how, result.bytes_sent) == ("resumed", 14 * MiB)
    assert stack.get_bytes(key) == data


# -- two nodes commit one checkpoint at once ------------------------------------------------


def test_two_racing_commits_of_one_checkpoint_one_wins_and_the_other_is_a_conflict(
    storage: Storage,
) -> None:
    """Two nodes commit different content under one checkpoint name, at the same moment
    (a barrier releases both conditional writes together): exactly one commits, the
    other is told of the conflict, and the stored manifest and LATEST are the winner's."""
    import threading

    from ckptd.commit.single import CommitConflictError, commit
    from ckptd.core.manifest import Manifest, build_manifest, parse_manifest
    from ckptd.repository import Repository

    def manifest_of(host: str, data: bytes) -> Manifest:
        _put(storage, f"run/checkpoint-7/{host}.bin", data)
        return build_manifest(
            run_id="run",
            checkpoint="checkpoint-7",
            step=7,
            layout="hf",
            host=host,
            created_at=0,
            committed_at=1,
            files=[(f"{host}.bin", len(data), checksum.to_hex(checksum.crc32c(data)))],
            environment={},
        )

    manifests = {host: manifest_of(host, os.urandom(100)) for host in ("node-a", "node-b")}
    barrier = threading.Barrier(2)
    outcome: dict[str, object] = {}

    def race(host: str) -> None:
        barrier.wait(timeout=30)
        try:
            outcome[host] = commit(storage, manifests[host])
        except CommitConflictError as exc:
            outcome[host] = exc

    threads = [threading.Thread(target=race, args=(h,)) for h in manifests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    conflicts = [h for h, o in outcome.items() if isinstance(o, CommitConflictError)]
    winners = [h for h in outcome if h not in conflicts]
    assert len(winners) == 1 and len(conflicts) == 1, outcome
    repo = Repository(storage)
    stored = repo.read_manifest_bytes("run", "checkpoint-7")
    assert stored is not None and parse_manifest(stored).host == winners[0]
    latest = repo.read_latest("run")
    assert latest is not None and latest.checkpoint == "checkpoint-7"
