"""Pure pieces at the scale of 100,000 files: the manifest, the upload plan, the
concurrency rule. Each runs in seconds; none may grow faster than the number of files."""

from __future__ import annotations

import functools
import random

from ckptd.core import checksum
from ckptd.core.concurrency import SMALL_FILE_MAX, lanes_for
from ckptd.core.manifest import Manifest, build_manifest, parse_manifest
from ckptd.layouts.base import FileEntry
from ckptd.sync.plan import CopySources, plan_upload, resolve_copies

FILES = 100_000


def _files(seed: int) -> list[tuple[str, int, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(FILES):
        # Orbax/zarr-like nesting for some, DCP-like flat shards for the rest.
        path = f"state/param{i % 97}/{i}.chunk" if i % 3 == 0 else f"__{i}_0.distcp"
        size = rng.randint(4 * 1024, 64 * 1024)
        out.append((path, size, checksum.to_hex(rng.getrandbits(32))))
    return out


@functools.cache
def _manifest() -> Manifest:
    return build_manifest(
        run_id="run",
        checkpoint="step-500",
        step=500,
        layout="dcp",
        host="node-0",
        created_at=1_700_000_000,
        committed_at=1_700_000_060,
        files=_files(1),
        environment={"python": "3.11"},
    )


def test_a_manifest_of_100000_files_is_built_written_and_read_back_the_same() -> None:
    files = _files(1)
    manifest = _manifest()
    data = manifest.to_bytes()
    back = parse_manifest(data)
    assert back == manifest
    assert len(back.files) == FILES
    assert back.total_bytes == sum(size for _, size, _ in files)
    assert {(f.path, f.size, f.crc32c) for f in back.files} == set(files)
    # About a hundred bytes a file: 100,000 files are a manifest of ~10 MB, one PUT.
    assert len(data) < 120 * FILES


def test_the_plan_of_100000_files_against_a_previous_checkpoint_of_as_many_indexes_it_once() -> (
    None
):
    previous = _manifest()
    sources = CopySources.of(previous)
    entries = [FileEntry(path, size, 1) for path, size, _ in _files(1)]
    # Small files are sent again rather than copied: none is a copy candidate.
    plan = plan_upload(entries, sources, {}, min_copy_size=SMALL_FILE_MAX + 1)
    assert len(plan.upload) == FILES and not plan.copy_candidates
    # Large ones of the same size and CRC-32C are copied, each from its own path.
    big = [FileEntry(f"big/{i}.bin", SMALL_FILE_MAX + 1 + i, 1) for i in range(50)]
    index = CopySources.of(
        previous.model_copy(
            update={
                "files": [
                    *previous.files,
                    *(
                        previous.files[0].model_copy(
                            update={"path": e.path, "size": e.size, "crc32c": "0000abcd"}
                        )
                        for e in big
                    ),
                ]
            }
        )
    )
    plan = plan_upload([*entries, *big], index, {}, min_copy_size=SMALL_FILE_MAX + 1)
    assert plan.copy_candidates == tuple(big)
    copies, again = resolve_copies(big, {e.path: "0000abcd" for e in big}, index)
    assert [(c.file.path, c.source_path) for c in copies] == [(e.path, e.path) for e in big]
    assert again == []


def test_small_files_get_more_requests_in_flight_than_parts_and_one_setting_scales_both() -> None:
    assert lanes_for(8) == 32
    assert lanes_for(1) == 4
    assert lanes_for(64) == 256
    assert all(lanes_for(c) >= c for c in range(1, 65))
