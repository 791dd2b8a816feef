"""``ckptd doctor``: the preflight a user runs before the first job (an init step can run
it too), one ``Finding`` per check, each ok / warn / fail with its fix.

The checks, in the order printed, and where each lives:

    config                       what ``run`` would use (invalid: exit 2 before any check)
    credentials, destination,    each destination (``[destination]``, each ``[[tiers]]``):
    checksums, clock,            accepted, exists and takes a write, the CRC-32C it reports,
    create-only                  its clock, create-only writes refused the second time
                                 (``doctor.store``; probes only under ``.ckptd-doctor/``)
    metadata, slurm              what announces a preemption (``doctor.cloud``)
    trainer, disk, token,        this node: the process a notice signals, free space, the
    control                      control API's token and socket (``doctor.node``)
    health                       with ``[health]`` on: which health sources this node lets
                                 the daemon read (``doctor.health``)

The verdicts' rules and bounds are in ``doctor.findings`` (pure). A check never changes
the node or the store beyond its probes, and never raises: what goes wrong is a finding.
"""

from __future__ import annotations

from ckptd.config import Settings
from ckptd.doctor.cloud import check_metadata, check_slurm
from ckptd.doctor.findings import Finding, document, exit_code
from ckptd.doctor.health import check_health
from ckptd.doctor.node import check_control, check_disk, check_token, check_trainer
from ckptd.doctor.store import DestinationChecks


def config_finding(settings: Settings, source: str) -> Finding:
    """What the configuration amounts to (it is valid: ``load_settings`` passed it)."""
    tiers = len(settings.tiers)
    where = settings.destination.url + (f" and {tiers} further tier(s)" if tiers else "")
    if not settings.watch:
        return Finding(
            "config",
            "warn",
            f"{source}: destination {where}; no [[watch]] dir",
            "add a [[watch]] dir (or pass --watch): `ckptd run` needs one, `ckptd exec` "
            "takes --watch",
        )
    dirs = ", ".join(str(w.dir) for w in settings.watch)
    return Finding("config", "ok", f"{source}: destination {where}; watching {dirs}")


def run_checks(settings: Settings, *, source: str) -> list[Finding]:
    """Every check, in order (module doc); ``source`` says where the config came from."""
    findings = [config_finding(settings, source)]
    several = bool(settings.tiers)
    for destination in [settings.destination, *settings.tiers]:
        where = destination.name if several else ""
        findings += DestinationChecks(destination, where=where).run()
    findings += [check_metadata(settings), check_slurm(settings), check_trainer(settings)]
    findings += check_disk(settings)
    findings += [check_token(settings), check_control(settings)]
    findings += check_health(settings)
    return findings


__all__ = ["Finding", "config_finding", "document", "exit_code", "run_checks"]
