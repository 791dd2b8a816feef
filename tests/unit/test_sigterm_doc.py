"""docs/preemption.md's table of what SIGTERM means under ``sigterm = "auto"`` is what
``ckptd.notices.shutdown.sigterm_meaning`` decides, row for row: the one statement of
SIGTERM's meaning every other page points to."""

from __future__ import annotations

import re
from pathlib import Path

from ckptd.notices.shutdown import sigterm_meaning

PAGE = Path(__file__).resolve().parents[2] / "docs" / "preemption.md"
# Each SIGTERM row of the table, by the words its first cell starts with: the
# environment and systemd state it describes.
ROWS = {
    "`systemctl stop": ({"INVOCATION_ID": "1"}, "running"),
    "the machine shutting down": ({"INVOCATION_ID": "1"}, "stopping"),
    "systemd cannot be asked": ({"INVOCATION_ID": "1"}, None),
    "a pod deleted in Kubernetes": ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),
    "`docker stop`": ({}, None),
}


def _sigterm_rows() -> dict[str, str]:
    """First cell -> third cell of the rows whose signal is SIGTERM."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) == 3 and cells[1] == "SIGTERM":
            rows[cells[0]] = cells[2]
    return rows


def test_the_preemption_page_says_what_the_code_decides_for_each_sigterm() -> None:
    rows = _sigterm_rows()
    assert len(rows) == len(ROWS), sorted(rows)
    for start, (environ, state) in ROWS.items():
        (does,) = [text for first, text in rows.items() if first.startswith(start)]
        documented = re.match(r"a (notice|plain stop)", does)
        assert documented, does
        meaning = sigterm_meaning("auto", environ, lambda state=state: state)
        assert meaning.notice == (documented[1] == "notice"), (start, meaning.why)
