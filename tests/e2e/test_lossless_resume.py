"""Proof of lossless resume: a run interrupted by preemption notices and by hard kills
(trainer and daemon ``kill -9``, local disk wiped), each time restored onto a fresh node
with ``ckptd restore --latest`` and resumed, ends bit-identical to an uninterrupted run.

Steps lost per interruption: 0 after a notice (the trainer saved where it stopped); after
a hard kill, the steps since the last committed save (< ``save_every`` here, where the
daemon is given time to commit that save before the node dies).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.devtools.locals3 import LocalS3
from tests.support.harness import (
    HF,
    LIGHTNING,
    PLAIN,
    Env,
    TrainerSpec,
    lossless_resume,
    markdown,
    plan,
)

SEED = 20261202


def test_plan_mixes_both_kinds() -> None:
    for seed in range(20):
        kinds = plan(seed, 3)
        assert len(kinds) == 3 and {"notice", "kill"} <= set(kinds)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [PLAIN, HF, LIGHTNING], ids=lambda s: s.name)
def test_interrupted_run_ends_bit_identical_to_an_uninterrupted_one(
    spec: TrainerSpec, tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    report = lossless_resume(
        spec, tmp_path, Env(s3_dest, local_s3.endpoint_url), seed=SEED, log=print
    )
    print(markdown(report))
    assert len(report.interruptions) == spec.interruptions
    assert {i.kind for i in report.interruptions} == {"notice", "kill"}
    for it in report.interruptions:
        if it.kind == "notice":
            assert it.steps_lost == 0, it
        else:
            assert 0 < it.steps_lost < spec.save_every, it
    assert report.identical, f"final weights differ from the reference: {report.mismatched}"


@pytest.mark.slow
@pytest.mark.parametrize(("cloud", "store"), [("gcp", "gcs"), ("azure", "azure")])
def test_a_hf_run_preempted_by_its_clouds_notice_resumes_bit_identical_from_that_clouds_store(
    cloud: str, store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The same proof with the cloud's own notice and store: GCP's notice and gs://
    (fake-gcs-server), Azure's and az:// (Azurite). Each emergency checkpoint is shipped
    there and restored onto a fresh node, and the run ends bit-identical."""
    import uuid

    prefix = f"lossless-{uuid.uuid4().hex[:8]}"
    if store == "gcs":
        endpoint = request.getfixturevalue("fake_gcs").endpoint_url
        dest = f"gs://ckpt/{prefix}"
    else:
        endpoint = request.getfixturevalue("azurite").endpoint_url
        dest = f"az://ckpt/{prefix}"
    report = lossless_resume(HF, tmp_path, Env(dest, endpoint, cloud), seed=SEED, log=print)
    print(markdown(report))
    assert {i.kind for i in report.interruptions} == {"notice", "kill"}
    assert all(i.steps_lost == 0 for i in report.interruptions if i.kind == "notice")
    assert report.identical, f"final weights differ from the reference: {report.mismatched}"
