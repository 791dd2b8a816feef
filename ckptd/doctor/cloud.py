"""``ckptd doctor``'s checks of what announces a preemption: the cloud's metadata service
(which cloud, and whether it answers the requests the notice source makes) and, inside a
Slurm job, Slurm's controller.

Neither is ever a failure: a node that cannot hear its cloud still ships every
checkpoint, and its SIGTERM is still a notice; it is a warning with the fix. The cloud
is found as the daemon finds it (``ckptd.notices.detect``), and each service is asked one
question of the kind its notice source asks, with the same headers, through no proxy,
within ``TIMEOUT_SECONDS``.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

from ckptd.config import Settings
from ckptd.doctor.findings import Finding
from ckptd.notices import aws, azure, gcp
from ckptd.notices.detect import DEFAULT_ENDPOINTS, DMI_DIR, Cloud, detect_cloud
from ckptd.notices.slurm import SlurmError, read_job
from ckptd.notices.slurm_job import job_id_of

TIMEOUT_SECONDS = 2.0
# A metadata request never goes through a proxy (as the notice sources' aiohttp sessions).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Unanswered(Exception):
    """The service did not answer as documented; the message says how."""


def _ask(
    method: str, url: str, headers: Mapping[str, str], timeout: float
) -> tuple[int, str, Mapping[str, str]]:
    """(status, body, headers by lower-cased name) of one request; _Unanswered when none
    came."""
    request = urllib.request.Request(url, method=method, headers=dict(headers))
    try:
        with _OPENER.open(request, timeout=timeout) as resp:
            return (
                resp.status,
                resp.read(4096).decode(errors="replace"),
                _lower(resp.headers.items()),
            )
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(4096).decode(errors="replace"), _lower(exc.headers.items())
    except TimeoutError:
        raise _Unanswered(f"no answer within {timeout:g} s") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Unanswered(str(reason)) from None


def _lower(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Response headers by lower-cased name (HTTP header names are case-insensitive)."""
    return {name.lower(): value for name, value in items}


def _aws(base: str, imdsv1_fallback: bool, timeout: float) -> str:
    """What IMDSv2 says: a token, then the spot instance-action."""
    headers: dict[str, str] = {}
    try:
        status, token, _ = _ask("PUT", base + aws.TOKEN_PATH, {aws.TOKEN_TTL_HEADER: "60"}, timeout)
        if status == 403:
            raise _Unanswered(
                "the token PUT answered 403: the instance metadata service is turned off "
                "(aws ec2 modify-instance-metadata-options --http-endpoint enabled)"
            )
        if status != 200:
            raise _Unanswered(f"the token PUT answered HTTP {status}")
        headers[aws.TOKEN_HEADER] = token.strip()
    except _Unanswered as exc:
        if not imdsv1_fallback:
            if "no answer" in str(exc):
                raise _Unanswered(
                    f"the IMDSv2 token PUT got no answer ({exc}): from a container behind a "
                    "bridge the metadata hop limit of 1 drops it; aws ec2 "
                    "modify-instance-metadata-options --http-put-response-hop-limit 2"
                ) from None
            raise
    status, body, _ = _ask("GET", base + aws.SPOT_PATH, headers, timeout)
    if status == 404:
        return "no spot interruption announced"
    if status == 200:
        return f"a spot interruption IS announced now: {body.strip()[:200]}"
    raise _Unanswered(f"spot/instance-action answered HTTP {status}")


def _gcp(base: str, timeout: float) -> str:
    url = base + gcp.INSTANCE_PATH + "preempted"
    status, body, headers = _ask("GET", url, {gcp.FLAVOR_HEADER: gcp.FLAVOR_VALUE}, timeout)
    if status != 200:
        raise _Unanswered(f"instance/preempted answered HTTP {status}")
    if headers.get(gcp.FLAVOR_HEADER.lower()) != gcp.FLAVOR_VALUE:
        raise _Unanswered(
            f"the answer lacks {gcp.FLAVOR_HEADER}: {gcp.FLAVOR_VALUE}: not the metadata server"
        )
    return f"preempted = {body.strip()[:20]}"


def _azure(base: str, timeout: float) -> str:
    url = f"{base}{azure.COMPUTE_NAME_PATH}?api-version={azure.COMPUTE_API_VERSION}&format=text"
    status, body, _ = _ask("GET", url, azure.METADATA_HEADERS, timeout)
    if status == 404:
        return "no VM name (every scheduled event is taken as this VM's)"
    if status != 200:
        raise _Unanswered(f"compute/name answered HTTP {status}: {body.strip()[:120]}")
    return f"VM {body.strip()[:64]}"


def check_metadata(
    settings: Settings, *, dmi_dir: Path = DMI_DIR, timeout: float = TIMEOUT_SECONDS
) -> Finding:
    """Which cloud announces preemptions to this node, and whether its service answers."""
    p = settings.preemption
    others = "SIGTERM" + (" and the Slurm job" if job_id_of(os.environ) else "")
    if p.provider == "none":
        return Finding(
            "metadata", "ok", f"preemption.provider = none: no cloud notices ({others} only)"
        )
    cloud: Cloud | None
    if p.provider == "auto":
        cloud = detect_cloud(dmi_dir)
        if cloud is None:
            return Finding(
                "metadata",
                "ok",
                f"no cloud detected from {dmi_dir} (preemption.provider = auto): notices come "
                f"from {others}; set preemption.provider if this is a cloud VM",
            )
        how = f"{cloud} (detected from {dmi_dir})"
    else:
        cloud = p.provider
        how = f"{cloud} (preemption.provider)"
    base = (p.endpoint or DEFAULT_ENDPOINTS[cloud]).rstrip("/")
    try:
        if cloud == "aws":
            said = _aws(base, p.imdsv1_fallback, timeout)
        elif cloud == "gcp":
            said = _gcp(base, timeout)
        else:
            said = _azure(base, timeout)
    except _Unanswered as exc:
        return Finding(
            "metadata",
            "warn",
            f"{how}: the metadata service at {base} does not answer: {exc}; no {cloud} "
            "preemption notice would be heard",
            "run where the metadata service is reachable (host network, or the hop limit), "
            "or set preemption.endpoint; preemption.provider = none if this is no cloud VM",
        )
    message = f"{how}: the metadata service at {base} answers: {said}"
    if "IS announced" in said:
        return Finding("metadata", "warn", message, "the daemon acts on it as soon as it starts")
    return Finding("metadata", "ok", message)


def check_slurm(settings: Settings, environ: Mapping[str, str] | None = None) -> Finding:
    """Inside a Slurm job: whether ``scontrol`` answers for it (the time limit and a
    preemption are read from it)."""
    environ = os.environ if environ is None else environ
    job = job_id_of(environ)
    if job is None:
        return Finding("slurm", "ok", "not in a Slurm job (SLURM_JOB_ID unset): nothing to check")
    if settings.slurm.enabled == "off":
        return Finding("slurm", "ok", f"job {job}: slurm.enabled = off, the job is not watched")
    try:
        state = read_job(job)
    except SlurmError as exc:
        return Finding(
            "slurm",
            "warn",
            f"job {job}: Slurm's controller cannot be asked: {exc}; the job's time limit and "
            "a preemption would not be seen coming",
            "run where scontrol is on PATH and reaches slurmctld, or slurm.enabled = off",
        )
    end = state.end_time.isoformat() if state.end_time else "no time limit"
    return Finding(
        "slurm", "ok", f"job {job} ({state.state}, partition {state.partition}): ends {end}"
    )


__all__ = ["check_metadata", "check_slurm"]
