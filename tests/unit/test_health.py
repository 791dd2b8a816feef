"""The health sources' pure readings and decisions (``ckptd.health``): real line and file
shapes in (tests/support/kernel_lines.py says where each is defined), events and
decisions out."""

from __future__ import annotations

import pytest

from ckptd.config import ConfigError, load_settings
from ckptd.health import disk, kmsg, memory
from ckptd.health.decide import Policy, SaveLimit
from ckptd.health.model import HealthEvent
from ckptd.health.store import Reachability
from ckptd.health.xid import XID_TABLE, classify
from tests.support import kernel_lines as k


def test_a_kmsg_record_of_xid_79_is_fatal_with_its_device() -> None:
    event = kmsg.parse_line(k.kmsg_record(7, k.XID_79), at=100.0)
    assert event is not None
    assert (event.source, event.kind, event.severity) == ("kmsg", "xid-79", "fatal")
    assert event.detail["device"] == "PCI:0000:03:00"
    assert event.message == k.XID_79 and event.at == 100.0


def test_a_row_remap_xid_is_degrading_and_an_application_fault_is_ignored() -> None:
    assert kmsg.parse_line(k.XID_63, 0.0).severity == "degrading"  # type: ignore[union-attr]
    assert kmsg.parse_line(k.XID_13, 0.0).severity == "ignore"  # type: ignore[union-attr]


def test_an_xid_not_in_the_table_is_a_warning_never_acted_on() -> None:
    event = kmsg.parse_line(k.XID_UNKNOWN, 0.0)
    assert event is not None and (event.kind, event.severity) == ("xid-154", "warning")


def test_the_xid_table_has_each_severity_and_cites_nvidia() -> None:
    severities = {e.severity for e in XID_TABLE.values()}
    assert severities == {"degrading", "fatal", "ignore"}
    assert classify(79).meaning == "GPU has fallen off the bus"


def test_the_oom_killer_taking_the_trainer_is_fatal_another_process_degrading() -> None:
    trainer = kmsg.parse_line(k.OOM_KILLED.format(pid=4153), 0.0, trainer_pids=[4153])
    other = kmsg.parse_line(k.OOM_NODE.format(pid=77), 0.0, trainer_pids=[4153])
    assert trainer is not None and (trainer.kind, trainer.severity) == ("oom-kill", "fatal")
    assert trainer.detail["cgroup"] is True and trainer.detail["comm"] == "python3"
    assert other is not None and (other.kind, other.severity) == ("oom-kill", "degrading")


def test_the_oom_summary_and_the_records_dictionary_are_not_counted_again() -> None:
    assert kmsg.parse_line(k.OOM_SUMMARY.format(pid=1), 0.0) is None
    for line in k.DICTIONARY.splitlines():
        assert kmsg.parse_line(line, 0.0) is None


@pytest.mark.parametrize(
    ("line", "device"),
    [(k.IO_ERROR, "nvme0n1"), (k.IO_ERROR_OLD, "sda"), (k.BUFFER_IO_ERROR, "sda1")],
)
def test_block_layer_io_errors_are_degrading(line: str, device: str) -> None:
    event = kmsg.parse_line(k.kmsg_record(3, line), 0.0)
    assert event is not None and (event.kind, event.severity) == ("io-error", "degrading")
    assert event.detail["device"] == device


def test_other_kernel_lines_are_no_event() -> None:
    assert kmsg.parse_line("6,339,5140900,-;NET: Registered protocol family 10", 0.0) is None
    assert kmsg.parse_line("", 0.0) is None


PSI = "some avg10=31.50 avg60=12.00 avg300=3.10 total=88123\nfull avg10={full} avg60=9.0 avg300=2.0 total=70111\n"


def test_memory_pressure_above_the_threshold_is_degrading_below_it_nothing() -> None:
    high = memory.pressure_event("/proc/pressure/memory", PSI.format(full="25.00"), 20.0, 1.0)
    assert high is not None and high.detail["full_avg10"] == 25.0
    assert memory.pressure_event("x", PSI.format(full="19.99"), 20.0, 1.0) is None
    assert memory.pressure_event("x", "garbage\n", 20.0, 1.0) is None


EVENTS = "low 0\nhigh 12\nmax 3\noom {oom}\noom_kill {kill}\noom_group_kill 0\n"


def test_a_cgroup_oom_kill_counts_only_what_grew_since_the_first_reading() -> None:
    base, first = memory.oom_kill_events(None, EVENTS.format(oom=2, kill=2), 0.0)
    assert first is None  # the first reading sets the baseline
    same, none = memory.oom_kill_events(base, EVENTS.format(oom=2, kill=2), 1.0)
    assert none is None
    _, grew = memory.oom_kill_events(same, EVENTS.format(oom=3, kill=3), 2.0)
    assert grew is not None and grew.detail == {"oom_kill": 3, "new": 1}


def test_a_cgroup_near_its_limit_is_degrading_and_max_means_no_limit() -> None:
    near = memory.limit_event("9800000000\n", "10000000000\n", 0.95, 0.0)
    assert near is not None and near.kind == "memory-limit"
    assert memory.limit_event("9000000000\n", "10000000000\n", 0.95, 0.0) is None
    assert memory.limit_event("9800000000\n", "max\n", 0.95, 0.0) is None


def test_a_disk_with_less_room_than_the_last_save_warns() -> None:
    event = disk.space_event("run1", "/data", 10 << 20, 16 << 20, 1.2, 0.0)
    assert event is not None and (event.kind, event.severity) == ("disk-space", "warning")
    assert disk.space_event("run1", "/data", 20 << 20, 16 << 20, 1.2, 0.0) is None
    assert disk.space_event("run1", "/data", 1, None, 1.2, 0.0) is None  # nothing to go by


def test_the_store_lost_gives_one_event_per_outage_after_the_threshold() -> None:
    reach = Reachability(30.0)
    assert reach.reading(False, "timed out", 100.0) is None
    assert reach.reading(False, "timed out", 129.0) is None
    event = reach.reading(False, "timed out", 130.0)
    assert event is not None and event.kind == "store-unreachable"
    assert reach.reading(False, "timed out", 200.0) is None  # the same outage
    assert reach.reading(True, "", 201.0) is None
    assert reach.reading(False, "refused", 202.0) is None
    assert reach.reading(False, "refused", 232.0) is not None  # a second outage


def _event(kind: str = "xid-63", severity: str = "degrading", at: float = 0.0) -> HealthEvent:
    return HealthEvent("kmsg", kind, severity, "m", at)  # type: ignore[arg-type]


POLICY = Policy({"degrading": "save", "fatal": "report", "warning": "report"}, 600.0)


def test_a_flood_of_one_kind_gives_one_save_per_interval() -> None:
    limit = SaveLimit()
    outcomes = [
        limit.decide(_event(at=t), POLICY, now=t, saving=False).outcome for t in range(0, 1300, 10)
    ]
    assert outcomes.count("save") == 3  # at 0, 600, 1200
    assert set(outcomes) == {"save", "report"}


def test_another_kind_has_its_own_limit_and_a_save_in_progress_defers_a_save() -> None:
    limit = SaveLimit()
    assert limit.decide(_event("xid-63"), POLICY, now=0, saving=False).outcome == "save"
    assert limit.decide(_event("io-error"), POLICY, now=1, saving=False).outcome == "save"
    held = limit.decide(_event("xid-74"), POLICY, now=2, saving=True)
    assert held.outcome == "defer" and "in progress" in held.why
    # Deferred is not spent: once the save is over, that kind still saves.
    assert limit.decide(_event("xid-74"), POLICY, now=3, saving=False).outcome == "save"


def test_fatal_is_recorded_never_saved_and_ignore_is_let_be() -> None:
    limit = SaveLimit()
    assert limit.decide(_event("xid-79", "fatal"), POLICY, now=0, saving=False).outcome == "report"
    assert limit.decide(_event("xid-13", "ignore"), POLICY, now=0, saving=False).outcome == "ignore"


def test_save_and_stop_is_a_notice_a_save_in_progress_does_not_hold_it() -> None:
    policy = Policy({"degrading": "save-and-stop"}, 600.0)
    assert SaveLimit().decide(_event(), policy, now=0, saving=True).outcome == "save-and-stop"


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("on_degrading", '"reboot"', "health.on_degrading"),
        ("kmsg", '"dev/kmsg"', "health.kmsg"),
        ("unreachable_seconds", "0", "health.unreachable_seconds"),
        ("save_interval_seconds", "-1", "health.save_interval_seconds"),
        ("disk_free_factor", "0.5", "health.disk_free_factor"),
        ("no_such_key", "1", "health.no_such_key"),
    ],
)
def test_a_bad_health_key_is_a_config_error_naming_it(
    tmp_path: object, key: str, value: str, named: str
) -> None:
    from pathlib import Path

    config = Path(str(tmp_path)) / "ckptd.toml"
    config.write_text(f"[health]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(config, environ={})
    assert caught.value.key == named and caught.value.exit_code == 2


def test_the_health_defaults_are_off_and_documented_values() -> None:
    h = load_settings(None, environ={}).health
    assert (h.enabled, h.unreachable_seconds, h.on_degrading, h.on_fatal) == (
        False,
        30.0,
        "save",
        "report",
    )


def _exporter(**gpu1: float) -> str:
    from tests.support.fakes.dcgm_exporter import FakeDcgmExporter

    fake = FakeDcgmExporter(gpus=2)
    if gpu1:
        fake.set_gpu(1, **gpu1)
    return fake.text()


def test_the_dcgm_exporters_page_reads_as_one_reading_per_gpu() -> None:
    from ckptd.health.dcgm import parse_exporter

    readings = parse_exporter(_exporter(DCGM_FI_DEV_XID_ERRORS=79, DCGM_FI_DEV_GPU_TEMP=93))
    assert [r.gpu for r in readings] == ["0", "1"]
    assert (readings[1].xid, readings[1].temperature_c, readings[1].dbe_total) == (79, 93.0, 0.0)
    assert readings[1].uuid.startswith("GPU-")
    assert parse_exporter("<html>not metrics") == []


def test_gpu_counters_are_events_when_they_grow_never_at_the_first_reading() -> None:
    from ckptd.health.dcgm import parse_exporter
    from ckptd.health.gpu import GpuWatch

    watch = GpuWatch("dcgm", 90.0)
    # A GPU that faulted before the daemon started is its baseline, not news.
    assert watch.events(parse_exporter(_exporter(DCGM_FI_DEV_XID_ERRORS=63)), 0.0) == []
    found = watch.events(
        parse_exporter(
            _exporter(
                DCGM_FI_DEV_XID_ERRORS=79,
                DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS=2,
                DCGM_FI_DEV_THERMAL_VIOLATION=1500,
                DCGM_FI_DEV_GPU_TEMP=95,
            )
        ),
        1.0,
    )
    got = {(key, e.kind, e.severity) for key, e in found}
    assert got == {
        ("", "xid-79", "fatal"),
        ("", "row-remap", "degrading"),
        ("dcgm:thermal-throttle:1", "thermal-throttle", "warning"),
        ("dcgm:gpu-temperature:1", "gpu-temperature", "warning"),
    }
    # The same page again: the Xid and the rows are old news; the heat lasts, the
    # throttling counter stood still so that condition is over.
    again = watch.events(
        parse_exporter(
            _exporter(
                DCGM_FI_DEV_XID_ERRORS=79,
                DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS=2,
                DCGM_FI_DEV_THERMAL_VIOLATION=1500,
                DCGM_FI_DEV_GPU_TEMP=95,
            )
        ),
        2.0,
    )
    assert [(key, e.kind) for key, e in again] == [("dcgm:gpu-temperature:1", "gpu-temperature")]


def test_a_health_save_is_never_carried_across_a_restart_as_a_drill_is_not(
    tmp_path: object,
) -> None:
    from datetime import UTC, datetime, timedelta
    from pathlib import Path

    from ckptd.daemon.health_loop import health_notice
    from ckptd.notices import carried

    state = Path(str(tmp_path))
    now = datetime.now(UTC)
    save = health_notice(_event(), "health-save", now, 600.0)
    carried.record(state, save, [])
    assert carried.load(state, now + timedelta(seconds=1)) is None
    stop = health_notice(_event(), "health-stop", now, 600.0)
    carried.record(state, stop, [])  # a stop is a notice: carried while in force
    loaded = carried.load(state, now + timedelta(seconds=1))
    assert loaded is not None and loaded[0].kind == "health-stop"


# /proc/diskstats as Documentation/admin-guide/iostats.rst lays it out (kernel 5.5+, 20
# fields): major minor name, reads, merged, sectors, ms reading, writes, merged, sectors,
# ms writing, in flight, ms doing I/O, weighted ms, discards (4), flushes (2).
DISKSTATS = (
    "   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
    " 254       0 vda {r} 10 8000 {rms} {w} 20 9000 {wms} 0 300 700 0 0 0 0 5 1\n"
)


def test_the_device_latency_is_the_time_spent_over_the_ios_completed_between_polls() -> None:
    from ckptd.health.diskstats import device_counts, latency_seconds

    before = device_counts(DISKSTATS.format(r=100, rms=50, w=200, wms=250), 254, 0)
    after = device_counts(DISKSTATS.format(r=110, rms=60, w=240, wms=490), 254, 0)
    assert before is not None and (before.name, before.ios, before.ms) == ("vda", 300, 300)
    assert latency_seconds(before, after) == (10 + 240) / 50 / 1000  # 5 ms per I/O
    assert latency_seconds(after, after) is None  # no I/O: no latency to tell
    assert device_counts(DISKSTATS.format(r=1, rms=1, w=1, wms=1), 0, 42) is None  # tmpfs


def test_a_dcgm_exporters_corrected_ecc_rate_is_read_per_minute_between_polls() -> None:
    from ckptd.health.dcgm import parse_exporter
    from ckptd.health.gpu import GpuWatch

    watch = GpuWatch("dcgm", 90.0, corrected_per_minute=60)
    assert watch.events(parse_exporter(_exporter(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL=5)), 0.0) == []
    # 15 in 10 s is 90 a minute: above 60.
    found = watch.events(parse_exporter(_exporter(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL=20)), 10.0)
    assert [(key, e.kind) for key, e in found] == [("dcgm:ecc-sbe-rate:1", "ecc-sbe-rate")]
    assert "90 corrected ECC errors a minute" in found[0][1].message
    # No bound: the same climb says nothing.
    quiet = GpuWatch("dcgm", 90.0)
    quiet.events(parse_exporter(_exporter(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL=5)), 0.0)
    assert quiet.events(parse_exporter(_exporter(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL=500)), 10.0) == []
