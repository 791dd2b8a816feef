"""Pure decisions: manifest rules, upload planning, checksums, LATEST order, rate limit."""

from __future__ import annotations

import json
import os

import crc32c as independent_crc
import pytest

from ckptd.core import checksum
from ckptd.core.manifest import (
    Latest,
    ManifestError,
    build_manifest,
    check_relative_path,
    parse_manifest,
    should_move_latest,
)
from ckptd.layouts.base import FileEntry
from ckptd.storage.limited import RateLimiter
from ckptd.sync.plan import plan_upload, resolve_copies


def _manifest(files: list[tuple[str, int, str]], step: int | None = 5) -> bytes:
    return build_manifest(
        run_id="run1",
        checkpoint="checkpoint-5",
        step=step,
        layout="hf",
        host="node",
        created_at=0,
        committed_at=9,
        files=files,
        environment={"ckptd": "0.1.0"},
    ).to_bytes()


def test_manifest_roundtrips_with_the_documented_shape() -> None:
    body = _manifest([("model.safetensors", 10, "1a2b3c4d"), ("config.json", 2, "00000001")])
    doc = json.loads(body)
    assert doc["format"] == "ckptd.manifest/1"
    assert doc["total_bytes"] == 12
    assert (
        doc["created_at"] == "1970-01-01T00:00:00Z"
        and doc["committed_at"] == "1970-01-01T00:00:09Z"
    )
    assert [f["path"] for f in doc["files"]] == ["config.json", "model.safetensors"]
    assert parse_manifest(body).file_map()["model.safetensors"].crc32c == "1a2b3c4d"


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.", "C:/x", "a\\b", "", "a\x00b"]
)
def test_unsafe_paths_are_rejected(path: str) -> None:
    with pytest.raises(ManifestError):
        check_relative_path(path)


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda d: d["files"].__setitem__(0, {**d["files"][0], "path": "../evil"}), "unsafe path"),
        (lambda d: d.__setitem__("total_bytes", 999), "total_bytes"),
        (lambda d: d["files"].append(dict(d["files"][0])), "duplicate"),
        (lambda d: d["files"].__setitem__(0, {**d["files"][0], "crc32c": "XYZ"}), "crc32c"),
        (lambda d: d.__setitem__("format", "other/9"), "format"),
        (lambda d: d.__setitem__("checkpoint", "a/b"), "single path component"),
    ],
)
def test_hostile_or_inconsistent_manifests_are_a_manifest_error(mutate: object, why: str) -> None:
    doc = json.loads(_manifest([("a.bin", 10, "1a2b3c4d")]))
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(ManifestError, match=why):
        parse_manifest(json.dumps(doc).encode())


def test_garbage_is_a_manifest_error_not_a_crash() -> None:
    for body in (b"", b"{", b"[]", b'{"format": "ckptd.manifest/1"}', os.urandom(64)):
        with pytest.raises(ManifestError):
            parse_manifest(body)


def test_a_file_under_another_file_is_rejected() -> None:
    doc = json.loads(_manifest([("a", 1, "00000000"), ("c", 1, "00000000")]))
    doc["files"][1]["path"] = "a/b"
    with pytest.raises(ManifestError, match="lies under file"):
        parse_manifest(json.dumps(doc).encode())


def test_latest_never_moves_backwards_in_step() -> None:
    current = Latest(checkpoint="checkpoint-50", step=50, manifest_crc32c="00000000")
    assert should_move_latest(None, 1)
    assert should_move_latest(current, 60)
    assert should_move_latest(current, 50)  # the same step re-committed
    assert not should_move_latest(current, 40)
    assert not should_move_latest(current, None)


def test_plan_skips_journalled_files_and_hashes_only_same_size_candidates() -> None:
    previous = parse_manifest(
        _manifest([("base.bin", 100, "0000abcd"), ("adapter.bin", 10, "00001234")])
    )
    files = [
        FileEntry("base.bin", 100, 1),  # same size as before: maybe unchanged
        FileEntry("adapter.bin", 11, 1),  # new size: upload
        FileEntry("done.bin", 5, 7),  # journalled as uploaded with the same mtime
        FileEntry("stale.bin", 5, 8),  # journalled, but rewritten since
    ]
    plan = plan_upload(files, previous, {"done.bin": (5, 7), "stale.bin": (5, 7)})
    assert [f.path for f in plan.copy_candidates] == ["base.bin"]
    assert [f.path for f in plan.upload] == ["adapter.bin", "stale.bin"]
    assert [f.path for f in plan.done] == ["done.bin"]


def test_copies_need_equal_size_and_crc_and_prefer_the_same_path() -> None:
    previous = parse_manifest(
        _manifest(
            [
                ("base.bin", 100, "0000abcd"),
                ("moved/base.bin", 100, "0000abcd"),
                ("other.bin", 100, "0000ffff"),
            ]
        )
    )
    same = FileEntry("base.bin", 100, 1)
    renamed = FileEntry("new/base.bin", 100, 1)
    changed = FileEntry("other.bin", 100, 1)
    copies, uploads = resolve_copies(
        [same, renamed, changed],
        {"base.bin": "0000abcd", "new/base.bin": "0000abcd", "other.bin": "00000000"},
        previous,
    )
    assert [(c.file.path, c.source_path) for c in copies] == [
        ("base.bin", "base.bin"),
        ("new/base.bin", "base.bin"),
    ]
    assert uploads == [changed]


def test_crc32c_matches_an_independent_implementation_and_combines() -> None:
    a, b = os.urandom(100_000), os.urandom(77_777)
    assert checksum.crc32c(a) == independent_crc.crc32c(a)
    assert checksum.combine(
        checksum.crc32c(a), checksum.crc32c(b), len(b)
    ) == independent_crc.crc32c(a + b)
    assert checksum.to_hex(checksum.crc32c(b"")) == "00000000"
    assert checksum.from_base64(checksum.to_base64(0xDEADBEEF)) == 0xDEADBEEF


def test_s3_composite_matches_what_the_store_computes() -> None:
    # AWS: a COMPOSITE multipart checksum is the CRC of the concatenated part CRCs, "-N".
    parts = [checksum.crc32c(os.urandom(1000)) for _ in range(3)]
    joined = b"".join(p.to_bytes(4, "big") for p in parts)
    assert checksum.s3_composite(parts) == f"{checksum.to_base64(independent_crc.crc32c(joined))}-3"
    assert checksum.s3_checksums_match("abc=-3", "abc=-3")
    assert checksum.s3_checksums_match("abc=", "abc=-3")  # moto omits the suffix
    assert not checksum.s3_checksums_match("abc=-2", "abc=-3")
    assert not checksum.s3_checksums_match("abd=-3", "abc=-3")


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_rate_limiter_holds_the_long_run_rate() -> None:
    clock = _FakeClock()
    limiter = RateLimiter(10 * 1024 * 1024, clock=clock, sleep=clock.sleep)
    for _ in range(20):
        limiter.acquire(5 * 1024 * 1024)  # 100 MiB in parts larger than a second's burst
    # The first second's burst is free; the other 90 MiB take 9 s at 10 MiB/s.
    assert clock.now == pytest.approx(9.0)


def test_rate_limiter_zero_means_unlimited() -> None:
    clock = _FakeClock()
    limiter = RateLimiter(0, clock=clock, sleep=clock.sleep)
    limiter.acquire(10**12)
    assert clock.now == 0


def test_rate_meter_averages_over_its_window_only() -> None:
    from ckptd.sync.rate import RateMeter

    meter = RateMeter(window=10.0)
    assert meter.rate(0.0) is None  # nothing measured yet
    meter.add(100, now=0.0)
    meter.add(100, now=1.0)
    assert meter.rate(now=2.0) == pytest.approx(100.0)  # 200 bytes over 2 s
    meter.add(1000, now=30.0)
    assert meter.rate(now=30.0) is None  # the old samples left the window
