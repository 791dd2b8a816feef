"""The health sources' readers over the real interfaces' stand-ins: the kernel log as a
FIFO and as a file fed with ``/dev/kmsg`` records (tests/support/kernel_lines.py), from
its end; a source that cannot be opened is said so, never raised; the watch dir's device
in the real ``/proc/diskstats``; the store's probe, one at a time, unanswered past its
interval an outage."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.health import kmsg
from ckptd.health.readers import KmsgReader, free_bytes, read_small
from tests.support import kernel_lines as k


def test_a_fifo_is_followed_line_by_line_across_partial_writes(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    reader = KmsgReader(str(fifo))
    try:
        assert reader.lines() == []  # open, no writer yet: nothing, no block
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            record = k.kmsg_record(1, k.XID_79)
            os.write(writer, record[:20].encode())
            assert reader.lines() == []  # half a record is kept, not parsed
            os.write(writer, (record[20:] + "\n" + k.kmsg_record(2, k.XID_63) + "\n").encode())
            got = reader.lines()
        finally:
            os.close(writer)
        kinds = [e.kind for e in (kmsg.parse_line(line, 0.0) for line in got) if e]
        assert kinds == ["xid-79", "xid-63"]
        assert reader.unreadable is None
    finally:
        reader.close()


def test_a_file_is_read_from_its_end_what_was_there_before_is_history(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(k.kmsg_record(1, k.XID_79) + "\n")
    reader = KmsgReader(str(log))
    try:
        assert reader.lines() == []
        with log.open("a") as out:
            out.write(k.kmsg_record(2, k.IO_ERROR) + "\n" + k.DICTIONARY + "\n")
        got = reader.lines()
        assert len(got) == 3
        assert [e.kind for e in (kmsg.parse_line(x, 0.0) for x in got) if e] == ["io-error"]
    finally:
        reader.close()


def test_a_kernel_log_that_cannot_be_opened_is_unreadable_with_why(tmp_path: Path) -> None:
    reader = KmsgReader(str(tmp_path / "absent"))
    assert reader.lines() == []
    assert reader.unreadable is not None and "cannot open" in reader.unreadable
    assert read_small(tmp_path / "absent") is None
    assert free_bytes(tmp_path / "absent") is None
    assert (free_bytes(tmp_path) or 0) > 0


def test_the_watch_dirs_device_latency_is_read_from_the_real_diskstats(tmp_path: Path) -> None:
    from ckptd.config import load_settings
    from ckptd.health.monitor import HealthMonitor, RunView
    from ckptd.health.readers import device_of
    from ckptd.runtime.logs import get_logger
    from ckptd.runtime.metrics import Metrics

    device = device_of(tmp_path)
    text = read_small(Path("/proc/diskstats")) or ""
    listed = device is not None and f" {device[0]} " in text
    config = tmp_path / "ckptd.toml"
    config.write_text('[health]\nenabled = true\nkmsg = ""\npsi = ""\n')
    metrics = Metrics()

    class Runs:
        def runs(self) -> dict[str, RunView]:
            return {"run": RunView(tmp_path, None)}

    monitor = HealthMonitor(
        load_settings(config, environ={}).health,
        tmp_path / "condition.json",
        Runs(),  # type: ignore[arg-type]
        metrics,
        wall=lambda: 0.0,
        log=get_logger(),
    )
    monitor.read(lambda: [], Runs().runs())
    probe = tmp_path / "probe"
    with probe.open("wb") as out:  # some I/O for the device to count
        out.write(os.urandom(1 << 20))
        out.flush()
        os.fsync(out.fileno())
    monitor.read(lambda: [], Runs().runs())
    value = metrics.registry.get_sample_value(
        "ckptd_health_disk_io_latency_seconds", {"run": "run"}
    )
    if not listed:
        assert value is None  # a device /proc/diskstats does not list (overlay, tmpfs)
        return
    # The fsync'ed write completed I/Os on the device between the two polls.
    assert value is not None and 0 <= value < 60


def test_a_store_probe_unanswered_past_its_interval_is_the_store_unreachable() -> None:
    import threading

    from ckptd.daemon.health_loop import StoreProbe
    from tests.support.daemon import wait_until

    now = [0.0]
    release = threading.Event()
    calls: list[int] = []

    def probe() -> None:
        calls.append(1)
        release.wait(10)  # a store that vanished: no answer until released

    store = StoreProbe(probe, 3.0, lambda: now[0])
    assert store.reading() == (True, "") and calls == []  # not due yet
    now[0] = 3.0
    assert store.reading() == (True, "")  # asked now, within its interval
    wait_until(lambda: calls, 5, "the probe running")
    now[0] = 6.5
    reachable, why = store.reading()
    assert not reachable and "no answer" in why
    assert len(calls) == 1  # one probe in flight at a time
    release.set()
    wait_until(lambda: store.answer is not None, 5, "the probe answered")
    assert store.reading() == (True, "")


@pytest.fixture
def no_pynvml() -> Iterator[None]:
    """No ``pynvml`` imported before the test (the stand-in's, or none), nor after it."""
    sys.modules.pop("pynvml", None)
    yield
    sys.modules.pop("pynvml", None)


STANDIN = Path(__file__).resolve().parents[1] / "support" / "fakes" / "nvml"


def _nvml_state(path: Path, **gpu1: object) -> None:
    quiet = {
        "uuid": "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52",
        "dbe": 0,
        "remapped": [0, 0, 0, 0],
        "thermal_ns": 0,
        "power_ns": 0,
        "temperature": 41,
    }
    path.write_text(json.dumps({"gpus": [quiet, {**quiet, **gpu1}]}))


def test_nvml_through_a_stand_in_reads_each_gpu_and_unsupported_queries_are_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pynvml: None
) -> None:
    from ckptd.health.gpu import GpuWatch
    from ckptd.health.nvml import NvmlReader

    state = tmp_path / "nvml.json"
    monkeypatch.setenv("NVML_STANDIN_STATE", str(state))
    monkeypatch.syspath_prepend(str(STANDIN))
    _nvml_state(state, dbe=None)  # ECC off on GPU 1: that query unsupported
    reader, watch = NvmlReader(), GpuWatch("nvml", 90.0)
    first = reader.readings()
    assert reader.unreadable is None and [r.gpu for r in first] == ["0", "1"]
    assert first[1].dbe_total is None and first[0].dbe_total == 0.0
    assert watch.events(first, 0.0) == []  # the baseline
    _nvml_state(state, dbe=None, remapped=[0, 2, 1, 0], thermal_ns=5_000_000, temperature=95)
    found = {(key, e.kind, e.severity) for key, e in watch.events(reader.readings(), 1.0)}
    assert found == {
        ("", "row-remap", "degrading"),
        ("nvml:row-remap-pending:1", "row-remap-pending", "warning"),
        ("nvml:thermal-throttle:1", "thermal-throttle", "warning"),
        ("nvml:gpu-temperature:1", "gpu-temperature", "warning"),
    }


def test_nvml_without_a_driver_or_the_package_is_unreadable_with_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pynvml: None
) -> None:
    from ckptd.health.nvml import NvmlReader

    absent = NvmlReader()
    assert absent.readings() == [] and "nvidia-ml-py is not installed" in (absent.unreadable or "")
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"init_error": "Driver Not Loaded", "gpus": []}))
    monkeypatch.setenv("NVML_STANDIN_STATE", str(state))
    monkeypatch.syspath_prepend(str(STANDIN))
    no_driver = NvmlReader()
    assert no_driver.readings() == [] and "Driver Not Loaded" in (no_driver.unreadable or "")


class LogLines:
    """The daemon's logger as the monitor calls it: (level, event, fields) per line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, object]]] = []

    def __getattr__(self, level: str) -> object:
        return lambda event, **fields: self.lines.append((level, event, fields))


def test_nvml_enabled_without_its_module_is_said_in_one_line_once_and_again_when_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pynvml: None
) -> None:
    from ckptd.config import load_settings
    from ckptd.health.monitor import HealthMonitor
    from ckptd.runtime.metrics import Metrics

    config = tmp_path / "ckptd.toml"
    config.write_text('[health]\nenabled = true\nkmsg = ""\npsi = ""\nnvml = true\n')
    metrics, log = Metrics(), LogLines()
    monitor = HealthMonitor(
        load_settings(config, environ={}).health,
        tmp_path / "condition.json",
        None,  # type: ignore[arg-type]  # no action is taken: nothing here is an event
        metrics,
        wall=lambda: 0.0,
        log=log,
    )
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import now raises ImportError
    for _ in range(3):  # three polls, one line
        assert monitor.read(lambda: [], {}) == []
        monitor.export()
    said = [(level, event, f) for level, event, f in log.lines if event.startswith("health_source")]
    assert len(said) == 1, log.lines
    level, event, fields = said[0]
    assert (level, event, fields["source"]) == ("warning", "health_source_unreadable", "nvml")
    why = str(fields["why"])
    assert "\n" not in why and why.startswith("nvidia-ml-py is not installed")
    assert "pip install 'nvidia-ml-py>=12'" in why and "pip install '.[nvml]'" in why
    assert "[health] nvml = false" in why
    assert metrics.registry.get_sample_value("ckptd_health_source_up", {"source": "nvml"}) == 0
    # Installed since (the stand-in): read at the next poll, and said so once.
    state = tmp_path / "nvml.json"
    _nvml_state(state)
    monkeypatch.setenv("NVML_STANDIN_STATE", str(state))
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delitem(sys.modules, "pynvml")
    for _ in range(2):
        monitor.read(lambda: [], {})
        monitor.export()
    said = [(level, event) for level, event, _ in log.lines if event.startswith("health_source")]
    assert said == [
        ("warning", "health_source_unreadable"),
        ("info", "health_source_readable"),
    ]
    assert metrics.registry.get_sample_value("ckptd_health_source_up", {"source": "nvml"}) == 1


def test_nvml_corrected_ecc_errors_climbing_faster_than_the_bound_are_degrading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pynvml: None
) -> None:
    from ckptd.health.gpu import GpuWatch
    from ckptd.health.nvml import NvmlReader

    state = tmp_path / "nvml.json"
    monkeypatch.setenv("NVML_STANDIN_STATE", str(state))
    monkeypatch.syspath_prepend(str(STANDIN))
    _nvml_state(state, sbe=1000)  # GPU 0's corrected count unsupported: never judged
    reader, watch = NvmlReader(), GpuWatch("nvml", 90.0, corrected_per_minute=60)
    first = reader.readings()
    assert first[0].sbe_total is None and first[1].sbe_total == 1000.0
    assert watch.events(first, 0.0) == []  # the baseline, however high
    _nvml_state(state, sbe=1030)  # 30 in 60 s: within the bound
    assert watch.events(reader.readings(), 60.0) == []
    _nvml_state(state, sbe=1130)  # 100 in 60 s: above it
    found = {(key, e.kind, e.severity) for key, e in watch.events(reader.readings(), 120.0)}
    assert found == {("nvml:ecc-sbe-rate:1", "ecc-sbe-rate", "degrading")}


def test_the_gpu_checks_nvml_step_reads_each_gpu_and_times_a_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pynvml: None
) -> None:
    """What bench/gpu_check.py reports of NVML on a lent GPU, through the stand-in here."""
    import importlib
    import sys

    state = tmp_path / "nvml.json"
    monkeypatch.setenv("NVML_STANDIN_STATE", str(state))
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    _nvml_state(state, sbe=7)
    sys.modules.pop("gpu_check", None)
    gpu_check = importlib.import_module("gpu_check")
    got = gpu_check.nvml_poll(polls=5)
    assert got["readable"] and got["polls"] == 5
    assert [g["gpu"] for g in got["gpus"]] == ["0", "1"] and got["gpus"][1]["sbe_total"] == 7.0
    assert got["wall_ms_per_poll"] >= 0 and got["cpu_ms_per_poll"] >= 0
