"""What one command line resolves to: its settings (the file, ``CKPTD_*`` variables and
the flags over them), the stores a read command opens, and the one JSON document that
``--json`` prints on stdout."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptd.cli.errors import UsageError
from ckptd.config import Settings, load_settings, require_destination
from ckptd.runtime import logs
from ckptd.storage.base import StorageError

if TYPE_CHECKING:
    from ckptd.store.tiers import TierStore


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags give, in the shape of the config file's tables."""
    out: dict[str, Any] = {}
    dest: dict[str, Any] = {}
    if getattr(args, "dest", None):
        dest["url"] = args.dest
    if getattr(args, "endpoint_url", None):
        dest["endpoint_url"] = args.endpoint_url
    if dest:
        out["destination"] = dest
    if getattr(args, "watch", None):
        watch: dict[str, Any] = {"dir": str(args.watch.expanduser().absolute())}
        if args.run_id:
            watch["run_id"] = args.run_id
        if getattr(args, "layout", None):
            watch["layout"] = args.layout
        out["watch"] = [watch]
    elif getattr(args, "layout", None) or (
        args.command in ("run", "exec", "config") and getattr(args, "run_id", None)
    ):
        raise UsageError("--run and --layout apply to --watch; give --watch DIR too")
    if getattr(args, "state_dir", None):
        out["state"] = {"dir": str(args.state_dir.expanduser().absolute())}
    return out


def settings_of(args: argparse.Namespace) -> Settings:
    """The effective settings: ``--config`` (or the default file), then the flags."""
    return load_settings(args.config, overrides=overrides(args))


def retry_logger(settings: Settings) -> Callable[[str, StorageError, int, float], None]:
    """A storage retry hook that logs each retry on stderr."""
    attempts = settings.destination.max_attempts
    log = logs.get_logger()

    def retrying(operation: str, error: StorageError, attempt: int, delay: float) -> None:
        # A dead endpoint is otherwise a silent wait: say what is retried, and for how long
        # at most (destination.max_attempts bounds it).
        log.warning(
            "store_retry",
            operation=operation,
            error=str(error),
            code=error.code,
            attempt=f"{attempt}/{attempts}",
            retry_in=round(delay, 2),
        )

    return retrying


def tiers_of(
    args: argparse.Namespace, settings: Settings, *, concurrency: int | None = None
) -> list[TierStore]:
    """The destinations a read command uses, in preference order: every configured tier,
    or only ``--dest`` when given (a URL on the command line names one store)."""
    from ckptd.store.tiers import open_tiers

    require_destination(settings)
    if getattr(args, "dest", None):
        settings = settings.model_copy(update={"tiers": []})
    tier = getattr(args, "tier", None)
    return open_tiers(settings, only=tier, concurrency=concurrency, on_retry=retry_logger(settings))


def print_json(doc: Any) -> None:
    """``doc`` as the one JSON document on stdout (indented, keys sorted)."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
