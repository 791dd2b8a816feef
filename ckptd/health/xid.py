"""Which NVIDIA Xid codes mean what for a training run: save now, too late, or let be.

The codes and their meanings are NVIDIA's: the Xid catalog
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, Ampere and
newer: code, mnemonic, description, resolution bucket) and the dynamic page retirement
guide (https://docs.nvidia.com/deploy/dynamic-page-retirement/visibility.html: Xid 48 a
double-bit ECC error, 63 a page retired or row remapped, 64 a retirement or remap that
failed). The severity is ckptd's reading of them for a trainer that can still save:

- degrading: the GPU runs on, but its memory or links are failing; the next fault may
  take the run, so save now (the trainer's process is not the one that failed);
- fatal: the GPU or the trainer's context is gone (fallen off the bus, an uncontained
  error, the GSP firmware not answering); no save can come from it, record it;
- ignore: the fault of one application (a bad address, an engine exception) or the
  driver's clean-up after one; the node is fine.

A code not in the table is a warning: reported, never acted on. Invariant: the table is
the only place a code's severity is written; docs/health.md shows it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.health.model import Severity

CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


@dataclass(frozen=True)
class XidEntry:
    """One Xid code: its severity for a training run, and NVIDIA's meaning."""

    code: int
    severity: Severity
    meaning: str


XID_TABLE: dict[int, XidEntry] = {
    e.code: e
    for e in (
        XidEntry(13, "ignore", "graphics engine exception (usually the application's fault)"),
        XidEntry(31, "ignore", "GPU memory page fault (usually the application's fault)"),
        XidEntry(43, "ignore", "GPU stopped processing (an application's channel reset)"),
        XidEntry(45, "ignore", "preemptive cleanup after earlier errors (a channel ended)"),
        XidEntry(48, "fatal", "double-bit (uncorrectable) ECC error"),
        XidEntry(63, "degrading", "ECC page retirement or row remapping recorded"),
        XidEntry(64, "degrading", "ECC page retirement or row remapping failed"),
        XidEntry(74, "degrading", "NVLink error"),
        XidEntry(79, "fatal", "GPU has fallen off the bus"),
        XidEntry(92, "degrading", "high single-bit ECC error rate"),
        XidEntry(94, "degrading", "contained ECC error (the affected context only)"),
        XidEntry(95, "fatal", "uncontained ECC error (every context on the GPU)"),
        XidEntry(119, "fatal", "GSP RPC timeout (the GPU's firmware does not answer)"),
        XidEntry(120, "fatal", "GSP error"),
    )
}


def classify(code: int) -> XidEntry:
    """The table's entry for ``code``; a code not in it is a warning."""
    found = XID_TABLE.get(code)
    if found is not None:
        return found
    return XidEntry(code, "warning", f"Xid {code}, not in ckptd's table (see {CATALOG_URL})")
