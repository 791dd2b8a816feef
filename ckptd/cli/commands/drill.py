"""``ckptd drill``: a simulated preemption against the running daemon, with its timings
(exit 1 when the emergency checkpoint was not committed before the deadline)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ckptd.cli.daemon_client import daemon_request
from ckptd.cli.errors import EXIT_OK
from ckptd.cli.humanize import human_bytes
from ckptd.cli.invocation import print_json
from ckptd.cli.options import DAEMON_URL_HELP, JSON_HELP, add_common
from ckptd.core.errors import EXIT_FAILED

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers


def add_parser(sub: Subparsers) -> None:
    drill = sub.add_parser(
        "drill", help="simulated preemption against the running daemon, with timings"
    )
    add_common(drill)
    drill.add_argument(
        "--deadline",
        type=float,
        default=120.0,
        help="seconds the simulated notice gives (default %(default)g)",
    )
    drill.add_argument("--url", default=None, help=DAEMON_URL_HELP)
    drill.add_argument("--json", action="store_true", help=JSON_HELP)


def handle(args: argparse.Namespace) -> int:
    _, doc = daemon_request(
        args,
        f"/v1/drill?deadline={args.deadline}",
        failure="drill failed",
        method="POST",
        timeout=args.deadline + 30,
    )
    ok = bool(doc.get("committed_before_deadline"))
    if args.json:
        print_json(doc)
    else:
        _print_timings(args.deadline, doc, ok)
    return EXIT_OK if ok else EXIT_FAILED


def _print_timings(deadline: float, doc: dict[str, Any], ok: bool) -> None:
    def at(key: str) -> str:
        value = doc.get(key)
        return "-" if value is None else f"{value:8.3f} s"

    pids, skipped = doc.get("trainer_pids") or [], doc.get("skipped_pids") or []
    found = pids or ("none signalled" if skipped else "none found")
    print(f"drill: deadline {deadline:.0f} s, trainer pids {found}")
    print(f"  {'noticed':<22} {0:8.3f} s")
    if pids:
        print(f"  {'trainer signalled':<22} {at('signalled_after_s')}")
    else:
        # Nothing was sent: a time here would read as if a trainer had been told.
        print(f"  {'trainer signalled':<22} {'no process signalled':>10}")
    if skipped:
        print(f"  {'spared (no handler)':<22} pids {skipped}")
    print(f"  {'checkpoint complete':<22} {at('complete_after_s')}   {doc.get('checkpoint') or ''}")
    print(
        f"  {'committed':<22} {at('committed_after_s')}   {human_bytes(int(doc.get('bytes') or 0))}"
    )
    if doc.get("notice_published") is not None:
        # Many nodes: the other nodes' daemons follow <run>/NOTICE; the timings above are
        # this node's own emergency checkpoint.
        published = "written" if doc["notice_published"] else "NOT written"
        print(f"  {'cluster NOTICE':<22} {published} (every node's trainer saves)")
    print(
        "result: "
        + ("committed before the deadline" if ok else "NOT committed before the deadline")
    )
