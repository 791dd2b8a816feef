"""What the tests share and never run themselves: the daemon as a subprocess
(``daemon``), the loopback fault proxy in front of the store (``faultproxy``), the fake
metadata services of the clouds (``fakes``), checkpoint writers (``writers``), the
operations tests' tools (``ops``, ``podman``), the trainer scripts run as children
(``trainers``) and the harnesses that drive them (``harness``, ``exec_harness``,
``cluster``)."""
