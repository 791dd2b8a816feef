"""Two daemons, one checkpoint name, different bytes (docs/design.md "Slots, claims and
trajectories"): on every store, whoever commits, the committed objects are byte-identical
to exactly one writer's files (read back from the store, not taken from the manifest), the
winner exits 0, the loser says conflict and exits 1, and nothing of the winner's is
touched; also with one racer killed with ``kill -9`` at a seeded instant and restarted.
A second node reusing a run id is loud, not committed, keeps its copy, and leaves the
store exactly as it was.

The short version; the campaign (20 races per store and more, with kills) is
``python -m tests.campaigns races`` (docs/guarantees.md, "Campaigns")."""

from __future__ import annotations

import json
import os
import random
import uuid
from pathlib import Path

import pytest

from ckptd.repository import Repository, object_key
from ckptd.storage import open_backend
from tests.support.daemon import run_cli
from tests.support.races import NAME, RUN, racer, run_race
from tests.support.writers import local_files, write_hf

SEED = int(os.environ.get("CAMPAIGN_SEED", random.SystemRandom().randrange(1 << 31)))


def destination(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, str]:
    prefix = f"race-{uuid.uuid4().hex[:8]}"
    if store == "seaweedfs":
        return f"s3://ckpt/{prefix}", request.getfixturevalue("local_s3").endpoint_url
    if store == "gcs":
        return f"gs://ckpt/{prefix}", request.getfixturevalue("fake_gcs").endpoint_url
    if store == "azure":
        return f"az://ckpt/{prefix}", request.getfixturevalue("azurite").endpoint_url
    return f"file://{tmp_path / 'store'}", ""


@pytest.mark.parametrize(
    ("store", "kill"),
    [
        ("seaweedfs", False),
        ("file", False),
        ("gcs", False),
        ("azure", False),
        ("seaweedfs", True),
        ("file", True),
    ],
)
def test_racing_writers_commit_exactly_one_writers_bytes(
    store: str, kill: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    print(f"campaign seed {SEED} (CAMPAIGN_SEED={SEED} repeats it)")
    dest, endpoint = destination(store, tmp_path, request)
    verdict = run_race(tmp_path / "race", dest, endpoint, random.Random(SEED), kill=kill)
    print(verdict.describe())
    assert verdict.problems == [], verdict.describe()


def test_a_second_node_reusing_a_run_id_is_refused_loudly_and_keeps_its_copy(
    tmp_path: Path, local_s3: object, s3_dest: str
) -> None:
    endpoint = local_s3.endpoint_url  # type: ignore[attr-defined]
    first = racer(tmp_path, "first", s3_dest, endpoint)
    assert run_cli("run", "--once", config=first.config).returncode == 0
    repo = Repository(open_backend(s3_dest, endpoint_url=endpoint))

    def stored() -> dict[str, bytes]:
        return {o.key: repo.storage.get_bytes(o.key) for o in repo.storage.list_objects(f"{RUN}/")}

    before = stored()
    second = racer(tmp_path, "second", s3_dest, endpoint)
    with open(second.config, "a") as fh:  # its local retention keeps one checkpoint
        fh.write("[retention]\nlocal_keep_last = 1\n")
    mine = second.files
    refused = run_cli("run", "--once", config=second.config)
    assert refused.returncode == 1, refused.stderr
    assert "conflict" in refused.stderr and "already committed" in refused.stderr
    assert stored() == before  # byte for byte, not one object more
    # A later checkpoint of the second node commits; retention never deletes the refused
    # one, and every --once says it is still not shipped.
    write_hf(second.root / "watch", 70, model_bytes=1 << 20)
    later = run_cli("run", "--once", config=second.config)
    assert later.returncode == 1 and f"{RUN}/{NAME}" in later.stderr, later.stderr
    (not_shipped,) = [
        json.loads(line) for line in later.stderr.splitlines() if "checkpoints_not_shipped" in line
    ]
    assert not_shipped["checkpoints"] == [f"{RUN}/{NAME}"]  # and says why, every time
    assert not_shipped["why"][f"{RUN}/{NAME}"].startswith("conflict: "), not_shipped
    assert "already committed" in not_shipped["why"][f"{RUN}/{NAME}"]
    assert repo.read_manifest(RUN, "checkpoint-70") is not None
    assert local_files(second.root / "watch" / NAME) == mine
    committed = repo.resolve(RUN, NAME)
    assert {
        f.path: repo.storage.get_bytes(object_key(RUN, committed.checkpoint, f.path))
        for f in committed.files
    } == first.files
