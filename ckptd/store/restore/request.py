"""What a restore is asked to do, what it did, and how it fails: the package's vocabulary.

A request names the checkpoint and the target, never the store: the same request goes
to each tier in turn (``ckptd.store.tiers``) until one's copy verifies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

from ckptd.core.errors import CkptdError
from ckptd.core.manifest import ManifestFile
from ckptd.core.signing import KeyRing
from ckptd.repository import RANGE_BYTES, FileProblem


class RestoreError(CkptdError):
    """A restore that did not complete; ``problems`` names the files at fault."""

    def __init__(self, message: str, problems: Sequence[FileProblem] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


@dataclass(frozen=True)
class RestoreRequest:
    """Restore ``checkpoint`` (None: the newest committed) of ``run_id`` as ``target_dir/NAME``.

    ``if_missing`` returns at once when ``DIR/NAME`` is already there whole (sizes
    only). ``concurrency`` ranged GETs of ``chunk_bytes`` run at a time. ``progress``
    None draws a bar when stderr is a terminal. ``take_lease`` False restores without
    a lease (read-only credentials, tests). ``environment`` is this node's (default
    ``ckptd.runtime.environment.describe()``). ``on_file`` is called with each path once
    it is verified and recorded (tests); ``on_verified`` as soon as it verified, before
    it is durable (a shared restore serves it from then on), and for each file an earlier
    attempt left verified in the staging dir before anything is fetched.
    ``order`` puts the files to fetch in the order they are fetched (a shared restore
    starts each node at its own place; default: the manifest's). ``part`` restores only
    that node's part of a many-node checkpoint. ``keys`` demands a signed manifest and checks every file's
    digest. (``ckptd.store.restore.procedure`` says what each implies.)
    """

    run_id: str
    checkpoint: str | None
    target_dir: Path
    _: KW_ONLY
    if_missing: bool = False
    concurrency: int = 8
    chunk_bytes: int = RANGE_BYTES
    progress: bool | None = None
    take_lease: bool = True
    environment: Mapping[str, str] | None = None
    on_file: Callable[[str], None] | None = None
    on_verified: Callable[[str], None] | None = None
    order: Callable[[Sequence[ManifestFile]], list[ManifestFile]] | None = None
    part: int | None = None
    keys: KeyRing | None = None


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did; ``skipped`` is True when ``if_missing`` found it in place."""

    run_id: str
    checkpoint: str
    step: int | None
    path: Path
    files: int
    total_bytes: int
    downloaded_bytes: int
    reused_bytes: int
    seconds: float
    skipped: bool = False
    environment_differences: dict[str, tuple[str, str | None]] = field(default_factory=dict)


__all__ = ["RestoreError", "RestoreRequest", "RestoreResult"]
