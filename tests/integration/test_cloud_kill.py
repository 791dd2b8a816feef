"""The short ``kill -9`` campaign against gs:// (fake-gcs-server) and az:// (Azurite):
the daemon is killed at a random instant of a multipart upload, started again on the
same state dir, and must then commit the checkpoint; a fresh-node restore must give the
same bytes; and no unfinished upload may be left behind (0 corrupt, 0 lost, 0 orphans).

The S3 campaign (``tests/campaigns``) classifies each kill by S3's request shapes; this
one aims by bytes sent, which every store reports the same way (the daemon's
``ckptd_upload_bytes_total``), with uploads capped so that a kill lands mid-file.
"""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path

import pytest

from ckptd.storage import Storage, open_backend
from tests.support.daemon import Daemon, run_cli, wait_until

pytestmark = pytest.mark.campaign

MiB = 1024 * 1024
TRIALS = 3
SEED = int(os.environ.get("CAMPAIGN_SEED") or random.SystemRandom().randrange(1 << 31))


def _checkpoint(root: Path, name: str) -> dict[str, bytes]:
    """An hf checkpoint: two files of several 5 MiB parts, the small ones, the marker last."""
    files = {
        "model.safetensors": os.urandom(23 * MiB + 17),
        "optimizer.pt": os.urandom(12 * MiB + 5),
        "config.json": b'{"layers": 2}',
        "trainer_state.json": b'{"global_step": 1}',
    }
    ckpt = root / name
    ckpt.mkdir(parents=True)
    for rel, data in files.items():
        (ckpt / rel).write_bytes(data)
    return files


def _unfinished(storage: Storage) -> list[str]:
    """Objects or markers of unfinished uploads, wherever the backend keeps them."""
    from ckptd.storage import MultipartUpload, capability

    uploads = capability(storage, MultipartUpload)
    assert uploads is not None
    return [f"{key} ({upload_id})" for key, upload_id in uploads.list_uploads("")]


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_kill_9_mid_upload_then_restart_commits_restores_identically_and_leaves_no_orphan(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    print(f"campaign seed {SEED} (CAMPAIGN_SEED={SEED} repeats it)")
    rng = random.Random(SEED)
    prefix = f"kill-{uuid.uuid4().hex[:8]}"
    if store == "gcs":
        endpoint = request.getfixturevalue("fake_gcs").endpoint_url
        dest = f"gs://ckpt/{prefix}"
    else:
        endpoint = request.getfixturevalue("azurite").endpoint_url
        dest = f"az://ckpt/{prefix}"
    storage = open_backend(dest, endpoint_url=endpoint)
    resumed = []
    for trial in range(TRIALS):
        resumed.append(_trial(tmp_path, trial, dest, endpoint, rng.random()))
        assert _unfinished(storage) == [], f"trial {trial}: orphans"
        keys = sorted(o.key for o in storage.list_objects(f"run/checkpoint-{trial + 1}/"))
        names = ("model.safetensors", "optimizer.pt", "config.json", "trainer_state.json")
        # The files, the claim written before them and the manifest written after.
        ours = (*names, "ckptd.claim.json", "ckptd.manifest.json")
        wanted = [f"run/checkpoint-{trial + 1}/{n}" for n in ours]
        assert keys == sorted(wanted), keys
    print(f"files resumed after each kill: {resumed}")
    # The kills landed inside uploads that the restart resumed, at least once.
    assert any(resumed), resumed


def _trial(tmp_path: Path, trial: int, dest: str, endpoint: str, where: float) -> int:
    """One kill and restart; the number of files the restarted daemon resumed."""
    watch = tmp_path / "run"
    name = f"checkpoint-{trial + 1}"
    files = _checkpoint(watch, name)
    total = sum(len(d) for d in files.values())
    config: dict[str, object] = {
        "watch": [{"dir": watch, "settle_seconds": 0.2}],
        "dest": dest,
        "endpoint_url": endpoint,
        "state_dir": tmp_path / "state",
        "part_size_mib": 5,
        "concurrency": 2,
    }
    first = Daemon.configured(tmp_path, name=f"first-{trial}", max_upload_mib_per_s=20, **config)
    # Somewhere between the first part and the last: a kill inside a multipart upload.
    at = 5 * MiB + int(where * (total - 11 * MiB))
    with first:
        wait_until(
            lambda: first.metric("ckptd_upload_bytes_total", run="run") >= at,
            120,
            f"{at} bytes sent",
        )
        first.kill9()
    assert not first.events_named("checkpoint_committed", checkpoint=name), "killed too late"
    second = Daemon.configured(tmp_path, name=f"second-{trial}", **config)
    with second:
        done = wait_until(
            lambda: second.events_named("checkpoint_committed", checkpoint=name),
            120,
            f"commit of {name} after the restart",
            details=second.log_text,
        )
    (tmp_path / "none.toml").write_text("")
    to = tmp_path / f"restored-{trial}"
    restored = run_cli(
        *("restore", "--dest", dest, "--endpoint-url", endpoint, "--run", "run"),
        *("--checkpoint", name, "--to", str(to), "--no-progress"),
        config=tmp_path / "none.toml",
    )
    assert restored.returncode == 0, restored.stderr[-2000:]
    for rel, data in files.items():
        assert (to / name / rel).read_bytes() == data, f"trial {trial}: {rel} differs"
    return int(done[0].get("resumed", 0))
