"""Near misses: a run id or a destination prefix that names nothing, and what is there.

A typo'd prefix (``s3://ckpt/pro`` for ``s3://ckpt/prod``) or run id reads as a run with
nothing committed, which ``ckptd exec`` takes for a new run (it starts from scratch) and
``ckptd restore`` reports as nothing to restore. ``where_runs_are`` says what the
destination holds instead, cheaply: one listing of the destination's runs, and only when
that is empty, one listing of the prefix above it, whose entries close to the asked
prefix's last segment are named (each a place runs may be; nothing below them is read).

The names are matched by ``close_names`` (pure): the ones ``difflib`` finds close, and
those that extend or shorten the asked one (``pro`` -> ``prod``, ``run1`` -> ``run1-b``).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from ckptd.config import DestinationConfig
from ckptd.core.url import parse_destination
from ckptd.storage import open_destination
from ckptd.storage.base import Storage, StorageError

# How many names a hint shows (the rest as "+N more").
SHOWN = 5


def close_names(asked: str, names: Sequence[str], limit: int = 3) -> list[str]:
    """The names in ``names`` a typo of ``asked`` could have meant, closest first."""
    candidates = [n for n in names if n != asked]
    found = difflib.get_close_matches(asked, candidates, n=limit, cutoff=0.6)
    for name in sorted(candidates):
        if len(found) >= limit:
            break
        if asked and (name.startswith(asked) or asked.startswith(name)) and name not in found:
            found.append(name)
    return found


def parent_url(url: str) -> tuple[str, str] | None:
    """``(the URL one segment up, the last segment)`` of a destination URL; None at a
    bucket's (or the filesystem's) root, which has nothing above it to list."""
    parsed = parse_destination(url)
    if parsed.root is not None:
        root = parsed.root
        return (f"file://{root.parent}", root.name) if root.parent != root else None
    if not parsed.prefix:
        return None
    above, _, last = parsed.prefix.rpartition("/")
    return f"{parsed.kind}://{parsed.bucket}" + (f"/{above}" if above else ""), last


def _shown(names: Sequence[str]) -> str:
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" (+{more} more)" if more > 0 else "")


@dataclass(frozen=True)
class RunHint:
    """What the destination holds when ``run`` is not there."""

    url: str
    run: str
    runs: tuple[str, ...] = ()  # the runs under the destination
    close_runs: tuple[str, ...] = ()  # those ``run`` may be a typo of
    beside: tuple[str, ...] = ()  # URLs beside an empty destination, close to its name

    @property
    def message(self) -> str:
        """One clause naming what is there ("" when nothing is: a new destination)."""
        if self.run in self.runs:
            return ""
        if self.runs:
            text = f"{self.url} holds run(s) {_shown(self.runs)}"
            if self.close_runs:
                text += " (did you mean " + " or ".join(repr(r) for r in self.close_runs) + "?)"
            return text
        if self.beside:
            return f"{self.url} holds no run; beside it: {_shown(self.beside)}"
        return ""


def where_runs_are(storage: Storage, config: DestinationConfig, run: str) -> RunHint:
    """What the destination ``storage`` (opened from ``config``) holds, for a ``run`` that
    names nothing there (module doc); a store that cannot be listed gives no hint."""
    url = storage.url
    try:
        runs = sorted(n for n in storage.list_children("") if not n.startswith("."))
    except StorageError:
        return RunHint(url, run)
    if runs:
        return RunHint(url, run, tuple(runs), tuple(close_names(run, runs)))
    above = parent_url(url)
    if above is None:
        return RunHint(url, run)
    parent, name = above
    try:
        siblings = open_destination(
            config.model_copy(update={"url": parent}), concurrency=1
        ).list_children("")
    except (StorageError, ValueError):
        return RunHint(url, run)
    near = close_names(name, [s for s in siblings if not s.startswith(".")])
    return RunHint(url, run, beside=tuple(f"{parent}/{s}" for s in near))


__all__ = ["SHOWN", "RunHint", "close_names", "parent_url", "where_runs_are"]
