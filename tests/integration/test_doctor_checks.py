"""``ckptd doctor``'s checks, each against the real thing it checks: every backend's store
(SeaweedFS, a directory, fake-gcs-server, Azurite), a store that ignores create-only writes
(the fault proxy in front of SeaweedFS, dropping If-None-Match and signing anew), the
fake metadata services and a dead one, real processes with and without a handler for the
save signal, Slurm's absence under SLURM_JOB_ID, and token files by their mode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.config import DestinationConfig, Settings
from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY, LocalS3
from ckptd.doctor import Finding
from ckptd.doctor.cloud import check_metadata, check_slurm
from ckptd.doctor.node import check_token, check_trainer
from ckptd.doctor.store import PROBE_DIR, DestinationChecks
from ckptd.storage import open_destination
from tests.support.daemon import wait_until
from tests.support.emulators import Azurite, FakeGCS
from tests.support.fakes import free_port
from tests.support.fakes.aws_imds import FakeAwsImds
from tests.support.fakes.azure_metadata import FakeAzureMetadata
from tests.support.fakes.gcp_metadata import FakeGcpMetadata
from tests.support.faultproxy import FaultProxy

STORE_CHECKS = ["credentials", "destination", "checksums", "clock", "create-only"]


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


@pytest.fixture(params=["seaweedfs", "file", "gcs", "azure"])
def destination(request: pytest.FixtureRequest, tmp_path: Path) -> DestinationConfig:
    prefix = f"doctor-{uuid.uuid4().hex[:8]}"
    if request.param == "seaweedfs":
        local_s3: LocalS3 = request.getfixturevalue("local_s3")
        return DestinationConfig(url=f"s3://ckpt/{prefix}", endpoint_url=local_s3.endpoint_url)
    if request.param == "gcs":
        fake_gcs: FakeGCS = request.getfixturevalue("fake_gcs")
        return DestinationConfig(url=f"gs://ckpt/{prefix}", endpoint_url=fake_gcs.endpoint_url)
    if request.param == "azure":
        azurite: Azurite = request.getfixturevalue("azurite")
        return DestinationConfig(url=f"az://ckpt/{prefix}", endpoint_url=azurite.endpoint_url)
    return DestinationConfig(url=f"file://{tmp_path / 'dest'}")


def test_every_backend_passes_every_store_check_and_keeps_nothing_of_the_probes(
    destination: DestinationConfig,
) -> None:
    findings = DestinationChecks(destination).run()
    assert [f.check for f in findings] == STORE_CHECKS
    assert [f.status for f in findings] == ["ok"] * 5, [f.line() for f in findings]
    assert "was refused, the first kept" in by_check(findings)["create-only"].message
    # The probes were written where doctor says, and are gone.
    assert PROBE_DIR in by_check(findings)["destination"].message
    assert list(open_destination(destination).list_objects("")) == []


def test_a_store_that_ignores_create_only_writes_fails_with_the_fix(
    fault_proxy: FaultProxy, s3_dest: str, s3_client: Any, s3_prefix: str
) -> None:
    """The stand-in is SeaweedFS behind the fault proxy dropping If-None-Match (and signing
    the request again): a real store that behaves as one that ignores it."""
    fault_proxy.ignore_create_only(ACCESS_KEY, SECRET_KEY)
    findings = by_check(
        DestinationChecks(DestinationConfig(url=s3_dest, endpoint_url=fault_proxy.url)).run()
    )
    create_only = findings["create-only"]
    assert create_only.status == "fail", create_only.line()
    assert "ignores create-only writes" in create_only.message
    assert "replaced the first" in create_only.message
    assert "honours conditional writes" in create_only.fix and "AWS S3" in create_only.fix
    assert fault_proxy.create_only_dropped == 2  # both conditional PUTs reached it bare
    assert all(findings[c].status == "ok" for c in STORE_CHECKS if c != "create-only")
    left = s3_client.list_objects_v2(Bucket="ckpt", Prefix=f"{s3_prefix}/")
    assert left.get("KeyCount", 0) == 0, left.get("Contents")


def test_a_missing_bucket_fails_naming_the_bucket_and_how_to_make_it(
    local_s3: LocalS3, missing_bucket: str
) -> None:
    findings = DestinationChecks(
        DestinationConfig(url=f"s3://{missing_bucket}/p", endpoint_url=local_s3.endpoint_url)
    ).run()
    assert [f.status for f in findings] == ["ok", "fail", "skip", "skip", "skip"]
    failed = by_check(findings)["destination"]
    assert f"bucket '{missing_bucket}' does not exist" in failed.message
    assert failed.fix == f"create it (aws s3 mb s3://{missing_bucket}) or correct destination.url"


def test_refused_credentials_fail_as_credentials(local_s3: LocalS3, monkeypatch: Any) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    findings = by_check(
        DestinationChecks(
            DestinationConfig(url="s3://ckpt/p", endpoint_url=local_s3.endpoint_url)
        ).run()
    )
    assert findings["credentials"].status == "fail"
    assert "access to bucket 'ckpt' denied" in findings["credentials"].message
    assert findings["destination"].status == "skip"


def _settings(**sections: Any) -> Settings:
    return Settings.model_validate(sections)


def test_an_unreachable_metadata_service_is_a_warning_with_the_fix() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    finding = check_metadata(_settings(preemption={"provider": "aws", "endpoint": dead}))
    assert finding.status == "warn", finding.line()
    assert "does not answer" in finding.message and "no aws preemption notice" in finding.message
    assert "preemption.endpoint" in finding.fix


@pytest.mark.parametrize(
    ("cloud", "fake", "says"),
    [
        ("aws", FakeAwsImds, "no spot interruption announced"),
        ("gcp", FakeGcpMetadata, "preempted = FALSE"),
        ("azure", FakeAzureMetadata, "answers"),
    ],
)
def test_each_clouds_metadata_service_is_recognised_and_asked(
    cloud: str, fake: Any, says: str
) -> None:
    server = fake()
    url = server.start_in_thread()
    try:
        finding = check_metadata(_settings(preemption={"provider": cloud, "endpoint": url}))
    finally:
        server.stop_thread()
    assert finding.status == "ok", finding.line()
    assert finding.message.startswith(f"{cloud} (preemption.provider)") and says in finding.message


def test_an_announced_spot_interruption_is_a_warning() -> None:
    with FakeAwsImds() as imds:
        imds.trigger_spot("terminate")
        finding = check_metadata(_settings(preemption={"provider": "aws", "endpoint": imds.url}))
    assert finding.status == "warn" and "IS announced" in finding.message


def test_no_cloud_detected_is_fine_and_says_where_notices_come_from(tmp_path: Path) -> None:
    finding = check_metadata(_settings(), dmi_dir=tmp_path)  # no DMI strings: no cloud
    assert finding.status == "ok" and "no cloud detected" in finding.message


def test_under_slurm_without_scontrol_is_a_warning_and_outside_slurm_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings()
    outside = check_slurm(settings, {})
    assert outside.status == "ok" and "not in a Slurm job" in outside.message
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol to be found
    inside = check_slurm(settings, {"SLURM_JOB_ID": "42"})
    assert inside.status == "warn" and "job 42" in inside.message, inside.line()
    assert "scontrol is not on PATH" in inside.message and "scontrol" in inside.fix
    off = check_slurm(_settings(slurm={"enabled": "off"}), {"SLURM_JOB_ID": "42"})
    assert off.status == "ok" and "slurm.enabled = off" in off.message


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[Any]:
    """Start processes whose command lines carry a marker, with or without a handler for
    SIGUSR1 (the save signal); ended by PID."""
    started: list[subprocess.Popen[bytes]] = []

    def start(marker: str, handler: bool) -> subprocess.Popen[bytes]:
        ready = tmp_path / f"ready-{len(started)}"
        script = (
            "import signal, sys, time, pathlib\n"
            + ("signal.signal(signal.SIGUSR1, lambda *a: None)\n" if handler else "")
            + f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(120)\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", script, marker])
        started.append(proc)
        wait_until(ready.exists, 30, "the process to start")
        return proc

    yield start
    for proc in started:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_no_trainer_process_is_a_warning_and_one_without_a_handler_too(sleeper: Any) -> None:
    marker = f"doctor-trainer-{uuid.uuid4().hex[:8]}"
    settings = _settings(trainer={"match": marker})
    none = check_trainer(settings)
    assert none.status == "warn" and "finds no process now" in none.message, none.line()
    bare = sleeper(marker, handler=False)
    spared = check_trainer(settings)
    assert spared.status == "warn" and str(bare.pid) in spared.message, spared.line()
    assert "ckptd.trainer.install()" in spared.fix
    handling = sleeper(marker, handler=True)
    found = check_trainer(settings)
    assert found.status == "ok" and f"({handling.pid})" in found.message, found.line()
    assert "1 without a handler would be spared" in found.message
    unset = check_trainer(_settings())
    assert unset.status == "warn" and "trainer.match" in unset.fix


@pytest.mark.parametrize(("mode", "status"), [(0o644, "fail"), (0o640, "fail"), (0o600, "ok")])
def test_a_token_file_others_can_read_fails_as_ssh_refuses_such_a_key(
    tmp_path: Path, mode: int, status: str
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cr3t-token\n")
    token.chmod(mode)
    finding = check_token(_settings(http={"token_file": str(token)}))
    assert finding.status == status, finding.line()
    if status == "fail":
        assert f"mode {mode:04o}" in finding.message and finding.fix == f"chmod 600 {token}"
    assert "s3cr3t" not in finding.line()


def test_an_unreadable_token_file_fails_naming_the_key(tmp_path: Path) -> None:
    finding = check_token(_settings(http={"token_file": str(tmp_path / "absent")}))
    assert finding.status == "fail" and finding.message.startswith("http.token_file: cannot read")
    assert os.path.basename(str(tmp_path / "absent")) in finding.message
