"""This node's failure domain, as its cloud's metadata service tells it.

Peer replication places a node's part on a peer in another failure domain where there
is one (``ckptd.peers.placement``): a zone's capacity is often reclaimed at once, and a
part and its replica must not go together. Asked once at start-up, from the same
metadata service the notice source reads (``[preemption] provider``, ``endpoint``):

- AWS (IMDSv2): ``placement/availability-zone``, and ``placement/group-name`` when the
  instance is in a placement group (``us-east-1a/pg-train``);
- GCP: ``instance/zone`` (its last path component, ``us-central1-a``);
- Azure: ``compute``'s ``zone``, else ``location`` and ``platformFaultDomain``
  (``eastus-fd1``).

Best effort: no answer within the timeout is "" (unknown), and placement then treats
every peer as another domain's. ``[peers] failure_domain`` overrides all of this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from ckptd.notices.aws import TOKEN_HEADER, TOKEN_PATH, TOKEN_TTL_HEADER
from ckptd.notices.detect import DEFAULT_ENDPOINTS, DMI_DIR, PROVIDERS, detect_cloud

TIMEOUT_SECONDS = 2.0


async def failure_domain(
    provider: str, endpoint: str, *, dmi_dir: Path = DMI_DIR, timeout: float = TIMEOUT_SECONDS
) -> str:
    """The failure domain the cloud's metadata gives (module doc), or ""."""
    choice = provider.strip().lower()
    if choice not in PROVIDERS or choice == "none":
        return ""
    cloud = detect_cloud(dmi_dir) if choice == "auto" else choice
    if cloud is None:
        return ""
    base = endpoint.strip() or DEFAULT_ENDPOINTS[cloud]  # type: ignore[index]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            if cloud == "aws":
                return await _aws(session, base)
            if cloud == "gcp":
                return await _gcp(session, base)
            return await _azure(session, base)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return ""


async def _aws(session: aiohttp.ClientSession, base: str) -> str:
    async with session.put(base + TOKEN_PATH, headers={TOKEN_TTL_HEADER: "60"}) as r:
        token = (await r.text()).strip() if r.status == 200 else ""
    headers = {TOKEN_HEADER: token} if token else {}

    async def item(name: str) -> str:
        async with session.get(f"{base}/latest/meta-data/placement/{name}", headers=headers) as r:
            return (await r.text()).strip() if r.status == 200 else ""

    zone = await item("availability-zone")
    group = await item("group-name") if zone else ""
    return f"{zone}/{group}" if zone and group else zone


async def _gcp(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(
        f"{base}/computeMetadata/v1/instance/zone", headers={"Metadata-Flavor": "Google"}
    ) as r:
        text = (await r.text()).strip() if r.status == 200 else ""
    return text.rsplit("/", 1)[-1]


async def _azure(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(
        f"{base}/metadata/instance/compute?api-version=2021-02-01", headers={"Metadata": "true"}
    ) as r:
        doc: Any = json.loads(await r.text()) if r.status == 200 else {}
    if not isinstance(doc, dict):
        return ""
    if doc.get("zone"):
        return str(doc["zone"])
    location, fault = doc.get("location"), doc.get("platformFaultDomain")
    return f"{location}-fd{fault}" if location and fault not in (None, "") else ""


__all__ = ["failure_domain"]
