"""How a many-node job is told apart from another job of the same run id: its job id,
configured or the launcher's, makes the writer every node of the job claims as."""

from __future__ import annotations

import pytest

from ckptd.config import LAUNCHER_JOB_ID_VARIABLES, ClusterConfig, load_settings
from ckptd.sync.claims import cluster_writer

TWO = {"cluster": {"nodes": 2, "node_rank": 0}}


def job_id(environ: dict[str, str], cluster: dict[str, object] | None = None) -> str | None:
    overrides = {"cluster": {**TWO["cluster"], **(cluster or {})}}
    return load_settings(overrides=overrides, environ=environ).cluster.job_id


@pytest.mark.parametrize("variable", LAUNCHER_JOB_ID_VARIABLES)
def test_the_job_id_comes_from_a_launcher_variable(variable: str) -> None:
    assert job_id({variable: "4711"}) == "4711"


def test_a_requeued_slurm_job_is_another_job_than_its_attempt_before() -> None:
    assert job_id({"SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "0"}) == "4711"
    assert job_id({"SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "2"}) == "4711.r2"


def test_torchruns_default_rendezvous_id_names_no_job() -> None:
    assert job_id({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert job_id({"TORCHELASTIC_RUN_ID": "none", "SKYPILOT_TASK_ID": "sky-1"}) == "sky-1"


def test_a_configured_job_id_beats_the_launcher() -> None:
    assert job_id({"SLURM_JOB_ID": "4711"}, {"job_id": "mine"}) == "mine"
    assert job_id({"SLURM_JOB_ID": "4711", "CKPTD_CLUSTER__JOB_ID": "env"}) == "env"


def test_one_node_ignores_a_launchers_job_id() -> None:
    settings = load_settings(overrides={}, environ={"SLURM_JOB_ID": "4711"})
    assert settings.cluster.job_id is None


def test_two_jobs_are_two_writers_and_no_job_id_is_the_one_shared_writer() -> None:
    x = ClusterConfig(nodes=2, node_rank=0, job_id="X")
    x1 = ClusterConfig(nodes=2, node_rank=1, job_id="X")
    y = ClusterConfig(nodes=2, node_rank=0, job_id="Y")
    assert cluster_writer(x) == cluster_writer(x1) == "cluster-2-X"
    assert cluster_writer(x) != cluster_writer(y)
    assert cluster_writer(ClusterConfig(nodes=2, node_rank=0)) == "cluster-2"
