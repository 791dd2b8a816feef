"""``ckptd report RUN``: where a run's time went (the run ledger), on the terminal, as
JSON, or as an HTML timeline (``--html FILE``, the ``report`` extra)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.cli.errors import EXIT_OK
from ckptd.cli.invocation import print_json, settings_of, tiers_of
from ckptd.cli.options import JSON_HELP, add_common
from ckptd.core.errors import CkptdError

if TYPE_CHECKING:
    from ckptd.cli.options import Subparsers


class ReportError(CkptdError):
    """The report cannot be made (exit 1): the store unreadable, a missing extra."""


def add_parser(sub: Subparsers) -> None:
    rep = sub.add_parser("report", help="where a run's time went: goodput and badput by cause")
    add_common(rep)
    rep.add_argument("run_id", metavar="RUN", help="the run id")
    rep.add_argument("--html", type=Path, default=None, help="also write the timeline here")
    rep.add_argument("--json", action="store_true", help=JSON_HELP)


def handle(args: argparse.Namespace) -> int:
    from ckptd.cadence.advisor import policy_of
    from ckptd.cadence.model import advise
    from ckptd.goodput.model import DAY_SECONDS, Mark, goodput
    from ckptd.goodput.recorder import read_ledger
    from ckptd.goodput.report import (
        MissingExtra,
        lost_comparison,
        summary_text,
        timeline_html,
    )
    from ckptd.storage.base import StorageError
    from ckptd.store.repository import Repository

    settings = settings_of(args)
    tier = tiers_of(args, settings)[0]
    repo = Repository(tier.storage)
    try:
        records = read_ledger(repo, args.run_id)
        history = repo.read_cadence(args.run_id)
    except StorageError as exc:
        raise ReportError(
            f"cannot read run {args.run_id!r} from {tier.storage.url}: {exc}"
        ) from exc
    finished = any(isinstance(r, Mark) and r.kind == "finished" for r in records)
    # A run still going (no finished mark) is counted until now: its last minutes unknown.
    until = None if finished or not records else time.time()
    run = goodput(records, until=until)
    day = goodput(records, until=until, since=run.end - DAY_SECONDS)
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
            }
        )
    else:
        print(summary_text(args.run_id, run, day, advice))
        if args.html is not None:
            print(f"timeline: {args.html}")
    return EXIT_OK
