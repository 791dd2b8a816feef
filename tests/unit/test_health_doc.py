"""docs/health.md's Xid table is ``ckptd.health.xid.XID_TABLE``, row for row: the page a
platform team reads to know which Xid makes the trainer save is the code that decides."""

from __future__ import annotations

import re
from pathlib import Path

from ckptd.health.xid import XID_TABLE

PAGE = Path(__file__).resolve().parents[2] / "docs" / "health.md"
ROW = re.compile(r"^\| (?P<code>\d+) \| (?P<severity>[a-z]+) \| (?P<meaning>.+?) \|$")


def test_the_pages_xid_table_is_the_code() -> None:
    rows = [m.groupdict() for line in PAGE.read_text().splitlines() if (m := ROW.match(line))]
    assert rows == [
        {"code": str(e.code), "severity": e.severity, "meaning": e.meaning}
        for e in XID_TABLE.values()
    ]
