"""Which cloud is this node on, and which notice source watches it.

Detection reads the SMBIOS strings the kernel exposes under ``/sys/class/dmi/id`` (the
world-readable ones; ``product_uuid`` and ``product_serial`` need root and are used only
when readable). It does no network I/O, so it cannot hang on a node without a metadata
service. The strings, as the clouds and the tools that detect them use them:

- AWS Nitro: ``sys_vendor`` / ``board_vendor`` = ``Amazon EC2`` (systemd's virt.c DMI
  table, https://github.com/systemd/systemd/blob/main/src/basic/virt.c); older Xen
  instances: ``bios_version`` / ``product_version`` such as ``4.11.amazon`` and a
  ``product_uuid`` starting ``ec2`` (cloud-init ``ds-identify``,
  https://github.com/canonical/cloud-init/blob/main/tools/ds-identify, and
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/identify_ec2_instances.html).
- GCP: ``product_name`` = ``Google Compute Engine`` (or ``Google``), ``sys_vendor`` /
  ``bios_vendor`` = ``Google``, ``product_serial`` starting ``GoogleCloud-`` (cloud-init
  ``DataSourceGCE.platform_reports_gce``,
  https://github.com/canonical/cloud-init/blob/main/cloudinit/sources/DataSourceGCE.py).
- Azure: ``chassis_asset_tag`` = ``7783-7084-3265-9085-8269-3286-77`` ("MSFT AZURE VM"
  in ASCII decimals); ``sys_vendor`` = ``Microsoft Corporation`` alone is any Hyper-V VM
  (cloud-init ``DataSourceAzure.ChassisAssetTag``,
  https://github.com/canonical/cloud-init/blob/main/cloudinit/sources/azure/identity.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import structlog

from ckptd.notices.model import NoticeSource

Cloud = Literal["aws", "gcp", "azure"]

DMI_DIR = Path("/sys/class/dmi/id")
AZURE_CHASSIS_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"

DEFAULT_ENDPOINTS: dict[Cloud, str] = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}

PROVIDERS = ("auto", "aws", "gcp", "azure", "none")

log = structlog.get_logger("ckptd.notices.detect")


def _read(dmi_dir: Path, name: str) -> str:
    try:
        return (dmi_dir / name).read_text(errors="replace").strip()
    except OSError:  # absent, or root-only (product_uuid, product_serial)
        return ""


def detect_cloud(dmi_dir: Path = DMI_DIR) -> Cloud | None:
    """The cloud this machine runs on, from DMI strings; None if none is recognised."""
    sys_vendor = _read(dmi_dir, "sys_vendor")
    product_name = _read(dmi_dir, "product_name")
    product_version = _read(dmi_dir, "product_version")
    board_vendor = _read(dmi_dir, "board_vendor")
    bios_vendor = _read(dmi_dir, "bios_vendor")
    bios_version = _read(dmi_dir, "bios_version")
    chassis_asset_tag = _read(dmi_dir, "chassis_asset_tag")
    product_uuid = _read(dmi_dir, "product_uuid")
    product_serial = _read(dmi_dir, "product_serial")

    if chassis_asset_tag == AZURE_CHASSIS_ASSET_TAG:
        return "azure"
    if (
        product_name in ("Google Compute Engine", "Google")
        or sys_vendor == "Google"
        or bios_vendor == "Google"
        or product_serial.startswith("GoogleCloud-")
    ):
        return "gcp"
    if (
        "Amazon EC2" in (sys_vendor, board_vendor, bios_vendor)
        or "amazon" in bios_version.lower()
        or "amazon" in product_version.lower()
        or bios_vendor.lower() == "amazon"
        or product_uuid.lower().startswith("ec2")
    ):
        return "aws"
    return None


def make_source(
    provider: str,
    endpoint: str,
    poll_interval: float,
    imdsv1_fallback: bool = False,
    *,
    dmi_dir: Path = DMI_DIR,
) -> NoticeSource | None:
    """The metadata notice source for ``provider`` (``[preemption]`` in the config).

    ``auto`` detects the cloud from DMI; ``none``, or ``auto`` on an unrecognised
    machine, gives None. An empty ``endpoint`` means the cloud's own. For GCP, whose
    watch is a hanging GET, ``poll_interval`` is the retry interval after an error.
    Construction does no I/O.
    """
    choice = provider.strip().lower()
    if choice not in PROVIDERS:
        raise ValueError(f"preemption.provider must be one of {', '.join(PROVIDERS)}: {provider!r}")
    if choice == "none":
        return None
    cloud: Cloud
    if choice == "auto":
        detected = detect_cloud(dmi_dir)
        log.info("cloud_detected", cloud=detected, dmi_dir=str(dmi_dir))
        if detected is None:
            return None
        cloud = detected
    else:
        cloud = choice  # type: ignore[assignment]  # checked against PROVIDERS above
    base = endpoint.strip() or DEFAULT_ENDPOINTS[cloud]
    # Imported here: they bring in aiohttp, which a node with no cloud never needs.
    from ckptd.notices.aws import AwsImdsSource
    from ckptd.notices.azure import AzureScheduledEventsSource
    from ckptd.notices.gcp import GcpMetadataSource

    if cloud == "aws":
        return AwsImdsSource(base, poll_interval=poll_interval, imdsv1_fallback=imdsv1_fallback)
    if cloud == "gcp":
        return GcpMetadataSource(base, retry_interval=poll_interval)
    return AzureScheduledEventsSource(base, poll_interval=poll_interval)
