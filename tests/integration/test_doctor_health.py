"""``ckptd doctor``'s health line (``ckptd.doctor.health``): each configured source opened
as the monitor would open it, on real files; what cannot be read is a warning with the
fix, and with ``[health]`` off there is no line at all."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.config import load_settings
from ckptd.doctor.health import check_health
from tests.support.fakes.dcgm_exporter import FakeDcgmExporter


def _settings(tmp_path: Path, health: str) -> object:
    config = tmp_path / "ckptd.toml"
    config.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n[health]\n{health}')
    return load_settings(config, environ={})


def test_readable_sources_are_ok_and_unreadable_ones_warn_naming_the_fix(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    psi = tmp_path / "psi"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    cgroup = tmp_path / "no-such-cgroup"
    settings = _settings(
        tmp_path,
        f'enabled = true\nkmsg = "{kmsg}"\npsi = "{psi}"\ncgroup = "{cgroup}"\n',
    )
    found = check_health(settings)  # type: ignore[arg-type]
    assert [(f.check, f.status) for f in found] == [
        ("health", "ok"),
        ("health", "ok"),
        ("health", "warn"),
        ("health", "ok"),
    ]
    assert str(cgroup) in found[2].message and "cat /proc/PID/cgroup" in found[2].fix


def test_a_kernel_log_without_access_warns_with_the_capability_to_grant(tmp_path: Path) -> None:
    settings = _settings(tmp_path, f'enabled = true\nkmsg = "{tmp_path / "absent"}"\npsi = ""\n')
    (kmsg, condition) = check_health(settings)  # type: ignore[arg-type]
    assert kmsg.status == "warn" and "cannot open" in kmsg.message
    assert "CAP_SYSLOG" in kmsg.fix
    assert condition.status == "ok"


def test_with_health_off_doctor_says_nothing_of_it(tmp_path: Path) -> None:
    assert check_health(_settings(tmp_path, "enabled = false\n")) == []  # type: ignore[arg-type]


def test_a_dcgm_exporter_is_ok_with_its_gpus_and_warns_when_it_does_not_answer(
    tmp_path: Path,
) -> None:
    exporter = FakeDcgmExporter(gpus=8)
    url = exporter.start_in_thread() + "/metrics"
    try:
        settings = _settings(tmp_path, f'enabled = true\nkmsg = ""\npsi = ""\ndcgm_url = "{url}"\n')
        (dcgm, _) = check_health(settings)  # type: ignore[arg-type]
        assert dcgm.status == "ok" and "8 GPU(s)" in dcgm.message
        exporter.set_mode("garbage")
        (dcgm, _) = check_health(settings)  # type: ignore[arg-type]
        assert dcgm.status == "warn" and "names no GPU" in dcgm.message
    finally:
        exporter.stop_thread()
    (gone, _) = check_health(settings)  # type: ignore[arg-type]
    assert gone.status == "warn" and "cannot read" in gone.message and "dcgm-exporter" in gone.fix


@pytest.fixture
def no_pynvml() -> Iterator[None]:
    """No ``pynvml`` imported before the test (the stand-in's, or none), nor after it."""
    sys.modules.pop("pynvml", None)
    yield
    sys.modules.pop("pynvml", None)


def test_nvml_is_ok_with_its_gpus_and_warns_naming_the_package_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pynvml: None
) -> None:
    settings = _settings(tmp_path, 'enabled = true\nkmsg = ""\npsi = ""\nnvml = true\n')
    (absent, _) = check_health(settings)  # type: ignore[arg-type]
    assert absent.status == "warn" and "pip install nvidia-ml-py" in absent.fix
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"gpus": [{"uuid": "GPU-0", "dbe": 0}] * 8}))
    monkeypatch.setenv("NVML_STANDIN_STATE", str(state))
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "support" / "fakes" / "nvml"))
    (nvml, _) = check_health(settings)  # type: ignore[arg-type]
    assert nvml.status == "ok" and "8 GPU(s)" in nvml.message
