"""Cloud detection from DMI, source selection, and the Notice model itself."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from ckptd.notices.aws import AwsImdsSource
from ckptd.notices.azure import AzureScheduledEventsSource
from ckptd.notices.detect import detect_cloud, make_source
from ckptd.notices.gcp import GcpMetadataSource
from ckptd.notices.model import Notice, NoticeSource, RateLimitedLog
from ckptd.notices.sigterm import SigtermSource

AZURE_TAG = "7783-7084-3265-9085-8269-3286-77"


def dmi(tmp_path: Path, **files: str) -> Path:
    """A fake /sys/class/dmi/id with the given files (values get the kernel's newline)."""
    root = tmp_path / "dmi"
    root.mkdir()
    for name, value in files.items():
        (root / name).write_text(value + "\n")
    return root


# -- detect_cloud ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "cloud"),
    [
        # Nitro instances
        (
            {"sys_vendor": "Amazon EC2", "product_name": "g5.xlarge", "bios_vendor": "Amazon EC2"},
            "aws",
        ),
        ({"board_vendor": "Amazon EC2"}, "aws"),
        # Xen-based instances
        ({"sys_vendor": "Xen", "product_name": "HVM domU", "bios_version": "4.11.amazon"}, "aws"),
        ({"sys_vendor": "Xen", "product_version": "4.2.amazon"}, "aws"),
        ({"sys_vendor": "Xen", "product_uuid": "EC2F58AF-2DAD-C57E-88C0-A81CB6084290"}, "aws"),
        # GCE
        (
            {
                "sys_vendor": "Google",
                "product_name": "Google Compute Engine",
                "bios_vendor": "Google",
            },
            "gcp",
        ),
        ({"product_name": "Google"}, "gcp"),
        ({"product_serial": "GoogleCloud-0123456789ABCDEF"}, "gcp"),
        # Azure: the chassis asset tag, not the Hyper-V vendor string
        (
            {
                "sys_vendor": "Microsoft Corporation",
                "product_name": "Virtual Machine",
                "chassis_asset_tag": AZURE_TAG,
            },
            "azure",
        ),
        (
            {
                "sys_vendor": "Microsoft Corporation",
                "product_name": "Virtual Machine",
                "chassis_asset_tag": "None",
            },
            None,
        ),
        # Neither
        ({"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)"}, None),
        ({"sys_vendor": "Xen", "product_name": "HVM domU", "bios_version": "4.11.0"}, None),
        ({}, None),
    ],
)
def test_detect_cloud_from_dmi(tmp_path: Path, files: dict[str, str], cloud: str | None) -> None:
    assert detect_cloud(dmi(tmp_path, **files)) == cloud


def test_detect_cloud_without_dmi_is_none(tmp_path: Path) -> None:
    assert detect_cloud(tmp_path / "no-such-dir") is None


def test_unreadable_dmi_files_are_skipped(tmp_path: Path) -> None:
    root = dmi(tmp_path, sys_vendor="Amazon EC2")
    (root / "product_uuid").mkdir()  # reading it fails, as a root-only file would
    assert detect_cloud(root) == "aws"


# -- make_source -----------------------------------------------------------------------


def test_make_source_none_and_undetected_give_no_source(tmp_path: Path) -> None:
    assert make_source("none", "", 1.0) is None
    assert make_source("auto", "", 1.0, dmi_dir=dmi(tmp_path, sys_vendor="QEMU")) is None


def test_make_source_auto_uses_the_detected_cloud(tmp_path: Path) -> None:
    root = dmi(tmp_path, chassis_asset_tag=AZURE_TAG)
    source = make_source("auto", "", 2.0, dmi_dir=root)
    assert isinstance(source, AzureScheduledEventsSource)
    assert source.endpoint == "http://169.254.169.254"
    assert source.poll_interval == 2.0


def test_make_source_per_provider() -> None:
    aws = make_source("AWS", "http://127.0.0.1:9/", 0.5, imdsv1_fallback=True)
    assert isinstance(aws, AwsImdsSource)
    assert (aws.endpoint, aws.poll_interval, aws.imdsv1_fallback) == (
        "http://127.0.0.1:9",
        0.5,
        True,
    )
    gcp = make_source("gcp", "", 0.5)
    assert isinstance(gcp, GcpMetadataSource)
    assert (gcp.endpoint, gcp.retry_interval) == ("http://metadata.google.internal", 0.5)
    azure = make_source("azure", "http://127.0.0.1:9", 0.5)
    assert isinstance(azure, AzureScheduledEventsSource)
    for source in (aws, gcp, azure, SigtermSource()):
        assert isinstance(source, NoticeSource)


def test_make_source_rejects_an_unknown_provider() -> None:
    with pytest.raises(ValueError, match=r"preemption\.provider"):
        make_source("oracle", "", 1.0)


# -- the Notice model ------------------------------------------------------------------


def test_notice_json_has_the_contract_keys() -> None:
    noticed = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
    notice = Notice(
        source="aws",
        kind="spot-termination",
        id="spot:terminate:2026-12-02T12:02:00Z",
        noticed_at=noticed,
        deadline=noticed + timedelta(minutes=2),
        detail={"action": "terminate"},
    )
    data = notice.to_json()
    assert {"source", "kind", "deadline", "noticed_at"} <= data.keys()
    assert data["deadline"] == "2026-12-02T12:02:00.000Z"
    assert data["noticed_at"] == "2026-12-02T12:00:00.000Z"
    assert Notice.from_json(data) == notice
    assert notice.seconds_left(noticed) == 120


def test_notice_times_are_utc_in_json_and_must_be_aware() -> None:
    paris = timezone(timedelta(hours=1))
    notice = Notice("drill", "drill", "d1", noticed_at=datetime(2026, 1, 1, 13, 0, tzinfo=paris))
    assert notice.to_json()["noticed_at"] == "2026-01-01T12:00:00.000Z"
    assert notice.to_json()["deadline"] is None
    with pytest.raises(ValueError, match="aware"):
        Notice("drill", "drill", "d2", noticed_at=datetime(2026, 1, 1))


def test_repeated_warnings_are_rate_limited() -> None:
    class Logger:
        def __init__(self) -> None:
            self.lines: list[tuple[str, str, dict[str, object]]] = []

        def warning(self, event: str, **kw: object) -> None:
            self.lines.append(("warning", event, kw))

        def info(self, event: str, **kw: object) -> None:
            self.lines.append(("info", event, kw))

    now = [0.0]
    logger = Logger()
    limited = RateLimitedLog(logger, interval=60, monotonic=lambda: now[0])
    for _ in range(10):
        limited.warning("spot", "read failed")
    assert len(logger.lines) == 1
    limited.warning("spot", "another failure")  # a different failure is news
    assert len(logger.lines) == 2
    now[0] = 61
    limited.warning("spot", "another failure")
    assert len(logger.lines) == 3
    limited.recovered("spot", "works again")
    limited.recovered("spot", "works again")  # only after a failure
    assert [line[0] for line in logger.lines] == ["warning", "warning", "warning", "info"]
    assert logger.lines[0][2]["endpoint"] == "spot"
