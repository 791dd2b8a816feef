"""Kernel-log lines as the kernel and NVIDIA's driver write them, for the health tests.

Each shape is quoted from where it is defined:

- ``/dev/kmsg`` records, ``<prio>,<seq>,<usec>,<flags>;<text>`` with a ``KEY=value``
  dictionary on lines starting with a space: the kernel's
  Documentation/ABI/testing/dev-kmsg.
- Xid lines: NVIDIA's driver, ``NVRM: Xid (PCI:<bus id>): <code>, <text>``, as shown in
  NVIDIA's Xid documentation (https://docs.nvidia.com/deploy/xid-errors/) and its
  dynamic page retirement guide; the texts of 63 and 79 are the driver's own.
- OOM kills: mm/oom_kill.c, ``__oom_kill_process`` (``"%s: Killed process %d (%s)
  total-vm:%lukB, anon-rss:%lukB, file-rss:%lukB, shmem-rss:%lukB, UID:%u pgtables:%lukB
  oom_score_adj:%hd"``, the message "Out of memory" or "Memory cgroup out of memory"),
  and the ``oom-kill:constraint=...`` summary of ``dump_oom_summary`` before it.
- I/O errors: block/blk-core.c, ``blk_print_req_error`` (``"%s error, dev %s, sector
  %llu op 0x%x:(%s) flags 0x%x phys_seg %u prio class %u"``, prefixed with the caller,
  ``blk_update_request``, on kernels 5.x), and fs/buffer.c's ``Buffer I/O error on dev``.
"""

from __future__ import annotations


def kmsg_record(seq: int, text: str, prio: int = 3) -> str:
    """One ``/dev/kmsg`` record (no dictionary) for ``text``."""
    return f"{prio},{seq},{5107644336 + seq},-;{text}"


XID_79 = "NVRM: Xid (PCI:0000:03:00): 79, GPU has fallen off the bus."
XID_63 = (
    "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, "
    "reset gpu to activate."
)
XID_13 = "NVRM: Xid (0000:01:00): 13, 0005 00000000 0000502d 00000104 00000000 00000100"
XID_UNKNOWN = "NVRM: Xid (PCI:0000:06:00): 154, GPU recovery action changed from 0x0 to 0x1"
OOM_SUMMARY = (
    "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/train,task_memcg=/train,task=python3,pid={pid},uid=1000"
)
OOM_KILLED = (
    "Memory cgroup out of memory: Killed process {pid} (python3) total-vm:23480812kB, "
    "anon-rss:15762172kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:31076kB "
    "oom_score_adj:0"
)
OOM_NODE = (
    "Out of memory: Killed process {pid} (dataloader) total-vm:912840kB, anon-rss:802112kB, "
    "file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:1796kB oom_score_adj:0"
)
IO_ERROR = "I/O error, dev nvme0n1, sector 2048 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio class 2"
IO_ERROR_OLD = (
    "blk_update_request: I/O error, dev sda, sector 12345 op 0x1:(WRITE) flags 0x0 "
    "phys_seg 1 prio class 0"
)
BUFFER_IO_ERROR = "Buffer I/O error on dev sda1, logical block 0, async page read"
DICTIONARY = " SUBSYSTEM=pci\n DEVICE=+pci:0000:03:00.0"
