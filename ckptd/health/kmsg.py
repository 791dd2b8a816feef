"""The kernel log's lines, read as health events: NVIDIA Xid, the OOM killer, I/O errors.

Shapes, as the kernel and the driver write them:

- ``/dev/kmsg`` gives one record per read, ``<prio>,<seq>,<usec>,<flags>[,...];<text>``,
  continuation lines (``KEY=value`` dictionary) starting with a space
  (Documentation/ABI/testing/dev-kmsg). A line without that prefix (``dmesg`` output, a
  file fed by hand) is taken as the text itself.
- The NVIDIA driver: ``NVRM: Xid (PCI:0000:03:00): 79, GPU has fallen off the bus.``
  (older drivers ``NVRM: Xid (0000:01:00): 13, ...``); the code decides, ``ckptd.health.xid``.
- The OOM killer (mm/oom_kill.c, ``__oom_kill_process``): ``Out of memory: Killed process
  1234 (python) total-vm:...`` or ``Memory cgroup out of memory: Killed process ...``.
  One such line per kill; the ``oom-kill:constraint=...`` summary before it is not
  counted again.
- The block layer (block/blk-core.c, ``blk_print_req_error``): ``I/O error, dev nvme0n1,
  sector 2048 op 0x1:(WRITE) ...`` (``blk_update_request: I/O error, dev sda, ...`` on
  older kernels), and the buffer cache's ``Buffer I/O error on dev sda1, logical block``.

Invariant: pure. A line is parsed alone, with the time it was read and the trainer's
PIDs as arguments; a line this module does not know is no event, never an error.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ckptd.health.model import HealthEvent
from ckptd.health.xid import classify

SOURCE = "kmsg"
# In every OOM-kill line: the trainer's PIDs are looked up only for a line that has it.
KILLED = "Killed process"

_KMSG_PREFIX = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;(?P<text>.*)$")
_XID = re.compile(r"NVRM: Xid \((?P<device>[^)]*)\): (?P<code>\d+),\s*(?P<rest>.*)$")
_OOM = re.compile(
    r"(?P<scope>Memory cgroup out of memory|Out of memory): Killed process (?P<pid>\d+) "
    r"\((?P<comm>[^)]*)\)"
)
_IO_ERROR = re.compile(r"I/O error,? (?:on )?dev (?P<device>[\w.:/-]+?),?(?:\s|$)")


def record_text(line: str) -> str | None:
    """The text of one ``/dev/kmsg`` record or plain log line; None for a continuation."""
    if line.startswith(" "):
        return None  # the record's dictionary (SUBSYSTEM=, DEVICE=)
    match = _KMSG_PREFIX.match(line)
    return match["text"] if match else line


def parse_line(line: str, at: float, trainer_pids: Collection[int] = ()) -> HealthEvent | None:
    """The health event in one kernel-log line, or None."""
    text = record_text(line.rstrip("\n"))
    if text is None:
        return None
    if (m := _XID.search(text)) is not None:
        entry = classify(int(m["code"]))
        return HealthEvent(
            SOURCE,
            f"xid-{entry.code}",
            entry.severity,
            text.strip(),
            at,
            {"xid": entry.code, "device": m["device"], "meaning": entry.meaning},
        )
    if (m := _OOM.search(text)) is not None:
        pid = int(m["pid"])
        # The trainer itself killed is too late to save; anything else killed means the
        # node is short of memory and the trainer may be next.
        trainer = pid in trainer_pids
        return HealthEvent(
            SOURCE,
            "oom-kill",
            "fatal" if trainer else "degrading",
            text.strip(),
            at,
            {
                "pid": pid,
                "comm": m["comm"],
                "cgroup": m["scope"].startswith("Memory cgroup"),
                "trainer": trainer,
            },
        )
    if (m := _IO_ERROR.search(text)) is not None:
        return HealthEvent(
            SOURCE, "io-error", "degrading", text.strip(), at, {"device": m["device"]}
        )
    return None
