"""``ckptd report --run RUN``: where a run's time went (the run ledger), on the terminal,
as JSON, or as an HTML timeline (``--html FILE``, the ``report`` extra).

The run is ``--run``, as in every other command. ``ckptd report RUN`` (the run as a
positional argument, the first form) still works, with a note on stderr that it is
deprecated; both at once must agree."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.cli.drillview import drill_line
from ckptd.cli.errors import EXIT_OK, UsageError
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import JSON_HELP, add_common
from ckptd.core.errors import CkptdError

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers
    from ckptd.repository import Repository


class ReportError(CkptdError):
    """The report cannot be made (exit 1): the store unreadable, a missing extra."""


def _drills(repo: Repository, run_id: str, last: int) -> dict[str, Any]:
    """The run's last drills (``DrillSummary.to_json``): the success rate, the last one."""
    from ckptd.drill.model import parse_record, summarize

    found = [r for r in map(parse_record, repo.read_drill_records(run_id, last)) if r]
    return summarize(found, last).to_json()


def add_parser(sub: Subparsers) -> None:
    rep = sub.add_parser("report", help="where a run's time went: goodput and badput by cause")
    add_common(rep)
    rep.add_argument("--run", dest="run_id", default=None, help="the run id")
    rep.add_argument(
        "old_run_id", nargs="?", metavar="RUN", help="deprecated: the run id (use --run)"
    )
    rep.add_argument("--html", type=Path, default=None, help="also write the timeline here")
    rep.add_argument("--json", action="store_true", help=JSON_HELP)


def run_of(args: argparse.Namespace) -> str:
    """The run asked for: ``--run``, else the deprecated positional (with a note on
    stderr); UsageError when neither is given or they differ."""
    if args.old_run_id is None:
        if args.run_id is None:
            raise UsageError("the following arguments are required: --run")
        return str(args.run_id)
    if args.run_id is not None and args.run_id != args.old_run_id:
        raise UsageError(f"--run {args.run_id} and RUN {args.old_run_id} name different runs")
    print(
        f"ckptd: note: 'ckptd report RUN' is deprecated: use 'ckptd report --run {args.old_run_id}'",
        file=sys.stderr,
    )
    return str(args.old_run_id)


def handle(args: argparse.Namespace) -> int:
    from ckptd.cadence.advisor import policy_of
    from ckptd.cadence.history import read_history
    from ckptd.cadence.model import advise
    from ckptd.goodput.model import DAY_SECONDS, goodput
    from ckptd.goodput.recorder import read_ledger
    from ckptd.goodput.report import (
        MissingExtra,
        lost_comparison,
        summary_text,
        timeline_html,
    )
    from ckptd.repository import Repository
    from ckptd.storage.base import StorageError

    args.run_id = run_of(args)
    settings = settings_of(args)
    tier = tiers_of(args, settings)[0]
    repo = Repository(tier.storage)
    try:
        records = read_ledger(repo, args.run_id)
        history = read_history(repo, args.run_id)
        drills = _drills(repo, args.run_id, settings.drill.history)
    except StorageError as exc:
        raise ReportError(
            f"cannot read run {args.run_id!r} from {tier.storage.url}: {exc}"
        ) from exc
    # A run still being recorded is counted until now (its last minutes unknown); one that
    # finished, stopped or was abandoned, until its end (ckptd.goodput.model.run_end).
    now = time.time()
    run = goodput(records, now=now)
    day = goodput(records, now=now, since=run.end - DAY_SECONDS)
    advice = advise(history, policy_of(settings)) if history.saves else None
    if args.html is not None:
        try:
            page = timeline_html(args.run_id, records, run)
        except MissingExtra as exc:
            raise ReportError(str(exc)) from exc
        args.html.write_text(page)
    if args.json:
        print_json(
            {
                "run": args.run_id,
                "goodput": run.to_json(),
                "last_24h": day.to_json(),
                "lost_per_interruption": lost_comparison(run, advice),
                "interruptions": [
                    {
                        "at": i.at,
                        "node": i.node,
                        "cause": i.cause,
                        "lost_steps": i.lost_steps,
                        "lost_seconds": round(i.lost_seconds, 3),
                    }
                    for i in run.interruptions
                ],
                "drills": drills,
            }
        )
    else:
        print(summary_text(args.run_id, run, day, advice))
        print(f"drills: {drill_line(args.run_id, drills, None)}")
        if args.html is not None:
            print(f"timeline: {args.html}")
    return EXIT_OK
