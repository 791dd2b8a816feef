"""The sections about what is shipped: ``[[watch]]``, ``[destination]``, ``[retention]``,
``[[tiers]]`` and ``[authentication]``.

Each key carries its description (``Field(description=...)``): docs/configuration.md is
generated from these models (``python -m ckptd.config.reference``), so the wording lives
here and nowhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from ckptd.config.base import (
    TIER_NAME,
    Section,
    absolute_path,
    check_http_url,
    check_key_file,
    parse_duration,
    run_id_problem,
)
from ckptd.config.errors import keyed_error, unset_destination
from ckptd.core.signing import KeyRing
from ckptd.core.url import (
    DestinationKind,
    DestinationURL,
    is_google_storage_host,
    parse_destination,
)

__all__ = [
    "AuthenticationConfig",
    "DestinationConfig",
    "Layout",
    "RetentionConfig",
    "TierConfig",
    "TierRetentionConfig",
    "WatchConfig",
]

Layout = Literal[
    "auto", "hf", "dcp", "deepspeed", "megatron", "lightning", "orbax", "marker", "quiescent"
]


class WatchConfig(Section):
    """One local checkpoint root; each direct child is one checkpoint."""

    dir: Path = Field(
        description="The local checkpoint root (absolute; `~` is expanded); each direct "
        "child is one checkpoint."
    )
    run_id: str | None = Field(
        default=None,
        description="The run's remote namespace (letters, digits and `. _ = -`); unset = "
        "the basename of `dir`. Each watch needs its own.",
    )
    layout: Layout = Field(
        default="auto",
        description="The completion rule that says when a checkpoint is complete; `auto` "
        "recognises the framework from the files.",
    )
    quiescence_seconds: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="For layout `quiescent`: complete once no file changed for this long "
        "and none is open for writing.",
    )
    settle_seconds: float = Field(
        default=2.0,
        ge=0,
        allow_inf_nan=False,
        description="The quiet window (no file changed) a checkpoint of layout hf, "
        "deepspeed, megatron, lightning or orbax must also show to count as complete.",
    )
    marker: str = Field(
        default="COMPLETE",
        description="For layout `marker`: the file name whose presence makes a checkpoint "
        "complete.",
    )
    rescan_seconds: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        # File events get lost (NFS, overflowing inotify queues).
        description="Period of the full rescan that catches what file events missed.",
    )
    ship_early: bool = Field(
        default=True,
        description="Send each closed, quiet file before the checkpoint is complete "
        "(to the first tier only).",
    )

    @field_validator("dir")
    @classmethod
    def _dir_is_absolute(cls, value: Path) -> Path:
        return absolute_path(value)

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_segment(cls, value: str | None) -> str | None:
        problem = None if value is None else run_id_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("marker")
    @classmethod
    def _marker_is_a_file_name(cls, value: str) -> str:
        if value in ("", ".", "..") or "/" in value or "\0" in value:
            raise ValueError("must be a file name (not empty, no '/')")
        return value

    @model_validator(mode="after")
    def _default_run_id_is_usable(self) -> WatchConfig:
        if self.run_id is None:
            problem = run_id_problem(self.dir.name)
            if problem:
                raise keyed_error(
                    ("run_id",),
                    f"is unset, and the basename of dir, {self.dir.name!r}, cannot stand in "
                    f"for it: it {problem}; set run_id",
                )
        return self

    @property
    def effective_run_id(self) -> str:
        """The remote namespace: ``run_id``, or the basename of ``dir`` when unset."""
        return self.run_id if self.run_id is not None else self.dir.name


class DestinationConfig(Section):
    """Where checkpoints go: ``s3://bucket[/prefix]``, ``gs://bucket[/prefix]``,
    ``az://container[/prefix]`` or ``file:///abs/path``."""

    url: str = Field(
        default="",
        description="`s3://bucket[/prefix]`, `gs://bucket[/prefix]`, `az://container[/prefix]` "
        "or `file:///absolute/path`; required by the commands that ship or read checkpoints.",
    )
    endpoint_url: str = Field(
        default="",
        description="An S3-compatible endpoint, `http(s)://host[:port]` (e.g. "
        "`http://127.0.0.1:8333`); empty = AWS. For gs://, a GCS endpoint or emulator "
        "(plain HTTP = an emulator, spoken to without credentials); empty = Google's, "
        "or `STORAGE_EMULATOR_HOST`. For az://, the account's blob endpoint "
        "(`https://ACCOUNT.blob.core.windows.net`, Azurite's "
        "`http://127.0.0.1:10000/devstoreaccount1`); empty = `AZURE_STORAGE_ACCOUNT_NAME`'s.",
    )
    region: str = Field(default="", description="The S3 region; empty = boto3's default.")
    # S3 multipart limits: parts are 5 MiB..5 GiB (the last part may be smaller).
    part_size_mib: int = Field(
        default=64,
        ge=5,
        le=5120,
        description="Multipart part size in MiB; a file beyond 10,000 parts gets larger ones.",
    )
    concurrency: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Parallel parts and files: the threads that read, checksum and send. "
        "Files up to 1 MiB get 4 per unit (32 requests in flight at the default): their "
        "time is the store's latency. `restore --concurrency` overrides it for a restore.",
    )
    max_upload_mib_per_s: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Node-wide upload cap in MiB/s, so training I/O is not starved; 0 = unlimited.",
    )
    max_attempts: int = Field(
        default=8,
        ge=1,
        le=100,
        description="Attempts per request on transient errors, with exponential backoff and "
        "full jitter. Also bounds how long `list`, `verify` and `restore` wait on a dead "
        "endpoint before they exit 1: with 8, about 13 s, at most 25 s.",
    )
    # SSE-C is not offered: S3 blocks it on new buckets since April 2026.
    sse: Literal["", "AES256", "aws:kms"] = Field(
        default="",
        description='S3 server-side encryption at rest: `""` (the bucket\'s default), '
        '`"AES256"` (SSE-S3) or `"aws:kms"` (SSE-KMS); s3:// destinations only.',
    )
    sse_kms_key_id: str = Field(
        default="",
        description='With `sse = "aws:kms"` only: the KMS key; empty = the account\'s default key. '
        "For gs://: the Cloud KMS key (`projects/P/locations/L/keyRings/R/cryptoKeys/K`) "
        "every object is written with; empty = the bucket's default. For az://: the "
        "encryption scope every blob and block is written with.",
    )
    name: str = Field(
        default="primary",
        description="The tier's name in metrics, status, `ckptd list` and `restore --tier` "
        "(1-32 letters, digits, `_` or `-`, starting with a letter).",
    )

    @field_validator("name")
    @classmethod
    def _name_is_a_label(cls, value: str) -> str:
        if not TIER_NAME.fullmatch(value):
            raise ValueError(
                "must be 1-32 letters, digits, _ or -, starting with a letter "
                '(it is a metric label), e.g. "nfs" or "s3"'
            )
        return value

    @field_validator("url")
    @classmethod
    def _url_is_supported(cls, value: str) -> str:
        # Empty is allowed here: only the commands that ship or read checkpoints need a
        # destination, and they call require_destination().
        if value:
            parse_destination(value)
        return value

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_http(cls, value: str) -> str:
        if value:
            check_http_url(value, allow_path=True)  # a path: az:// only (below)
        return value

    @model_validator(mode="after")
    def _endpoint_path_only_for_azure(self) -> DestinationConfig:
        path = urlsplit(self.endpoint_url).path
        if path not in ("", "/") and not self.url.startswith("az://"):
            raise keyed_error(
                ("endpoint_url",),
                "must be http(s)://host[:port], without a path (a path names the account "
                f"of an az:// destination only, as Azurite's /devstoreaccount1) (got {self.endpoint_url!r})",
            )
        return self

    @model_validator(mode="after")
    def _not_gcs_through_s3(self) -> DestinationConfig:
        host = urlsplit(self.endpoint_url).hostname or ""
        if self.url.startswith("s3://") and is_google_storage_host(host):
            raise keyed_error(
                ("endpoint_url",),
                f"is Google Cloud Storage ({host}), whose S3 API ignores the conditional "
                "write ckptd commits with: use url = gs://bucket[/prefix] and no endpoint_url",
            )
        return self

    @model_validator(mode="after")
    def _encryption_fits(self) -> DestinationConfig:
        kind = parse_destination(self.url).kind if self.url else ""
        if kind in ("gs", "az"):
            if self.sse:
                what = "a Cloud KMS key" if kind == "gs" else "an encryption scope"
                raise keyed_error(
                    ("sse",),
                    f"applies to s3:// only; {self.url} is encrypted with {what} named "
                    "by sse_kms_key_id alone, or the store's default",
                )
            return self
        if self.sse_kms_key_id and self.sse != "aws:kms":
            raise keyed_error(
                ("sse_kms_key_id",),
                f'is set, but sse is {self.sse!r}: a KMS key applies only with sse = "aws:kms"',
            )
        encrypted = bool(self.sse or self.sse_kms_key_id)
        if encrypted and kind == "file":
            raise keyed_error(
                ("sse",),
                f"server-side encryption applies to object stores, not {self.url!r}; "
                "encrypt the filesystem itself, or remove sse",
            )
        return self

    def _parsed(self) -> DestinationURL:
        if not self.url:
            raise unset_destination()
        return parse_destination(self.url)

    @property
    def kind(self) -> DestinationKind:
        """The scheme, "s3", "gs", "az" or "file"; ConfigError (destination.url) when none is set."""
        return self._parsed().kind

    @property
    def bucket(self) -> str:
        """The bucket (S3, GCS) or container (Azure); ValueError for a file:// destination."""
        parsed = self._parsed()
        if parsed.kind == "file":
            raise ValueError(f"destination {self.url!r} is a directory: it has no bucket")
        return parsed.bucket

    @property
    def prefix(self) -> str:
        """The key prefix under the bucket, without leading or trailing '/' ("" for none)."""
        parsed = self._parsed()
        if parsed.kind == "file":
            raise ValueError(f"destination {self.url!r} is a directory: it has no prefix")
        return parsed.prefix

    @property
    def root_path(self) -> Path:
        """The root directory of a file:// destination; ValueError for s3://."""
        root = self._parsed().root
        if root is None:
            raise ValueError(f"destination {self.url!r} is not file://: it has no root path")
        return root


class TierRetentionConfig(Section):
    """What one destination keeps (``ckptd.store.retention``): the union of the newest
    ``keep_last`` (0 = no count rule), every step multiple of ``keep_every_steps`` and
    everything committed within ``keep_within``; with no count and no age rule, all."""

    keep_last: int = Field(
        default=5, ge=0, description="Keep the newest this many checkpoints; 0 = no count rule."
    )
    keep_every_steps: int = Field(
        default=0,
        ge=0,
        description="Also keep every checkpoint whose step is a multiple of this; 0 = off.",
    )
    keep_within: str = Field(
        default="0",
        description="Also keep what was committed this recently, by the manifest's "
        '`committed_at`: `"7d"`, `"12h"`, `"30m"`, `"2w"` or seconds; `"0"` = off.',
    )

    @field_validator("keep_within", mode="before")
    @classmethod
    def _within_is_a_duration(cls, value: object) -> object:
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # a bare number of seconds
        if isinstance(value, str):
            parse_duration(value)
        return value

    @property
    def keep_within_seconds(self) -> float:
        """``keep_within`` in seconds (0 = off)."""
        return parse_duration(self.keep_within)


class RetentionConfig(TierRetentionConfig):
    """What the first destination keeps, by the rules of ``[tiers.retention]`` (a checkpoint
    is kept when any rule keeps it), and the node's local retention (0 = never delete,
    opt-in): local checkpoints are node-wide, so only ``[retention]`` has that key."""

    local_keep_last: int = Field(
        default=0,
        ge=0,
        description="Delete local checkpoints beyond the newest this many, only ones every "
        "tier has committed, never the newest; 0 = never delete.",
    )


class TierConfig(DestinationConfig):
    """One further destination (``[[tiers]]``), committed and retained on its own; the
    same keys as ``[destination]`` (``url`` and ``name`` required) and its own
    ``[tiers.retention]``. Order is restore preference: fastest first. Each tier needs its
    own name and url, and tiers are not supported with ``cluster.nodes`` > 1 yet."""

    name: str = Field(
        description="The tier's name, unique among the tiers and `[destination]`: a metric "
        "label, and what `restore --tier` takes."
    )
    url: str = Field(
        description="`s3://bucket[/prefix]`, `gs://bucket[/prefix]`, `az://container[/prefix]` "
        "or `file:///absolute/path`."
    )
    retention: TierRetentionConfig = Field(
        default_factory=TierRetentionConfig,
        description="This tier's own retention, `[tiers.retention]`: the keys of "
        "`[retention]` but `local_keep_last`.",
    )

    @field_validator("url")
    @classmethod
    def _url_is_set(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty: s3://bucket[/prefix] or file:///absolute/path")
        return value


class AuthenticationConfig(Section):
    """Authenticated checkpoints (``ckptd.core.signing``): key files, never keys."""

    key_file: str = Field(
        default="",
        description="The HMAC key file (absolute path, at least 32 bytes) that signs every "
        "manifest and verifies them; empty = manifests are not signed.",
    )
    verify_key_files: list[str] = Field(
        default_factory=list,
        description="Older key files still accepted when verifying (rotation); needs `key_file`.",
    )

    @field_validator("key_file")
    @classmethod
    def _key_is_usable(cls, value: str) -> str:
        if value:
            check_key_file(value)
        return value

    @field_validator("verify_key_files")
    @classmethod
    def _keys_are_usable(cls, values: list[str]) -> list[str]:
        for index, value in enumerate(values):
            try:
                check_key_file(value)
            except ValueError as exc:
                raise keyed_error((index,), str(exc)) from None
        return values

    @model_validator(mode="after")
    def _verify_needs_a_key(self) -> AuthenticationConfig:
        if self.verify_key_files and not self.key_file:
            raise keyed_error(
                ("verify_key_files",), "is set without key_file: set key_file (the current key)"
            )
        return self

    def key_ring(self) -> KeyRing | None:
        """The keys, or None when authentication is off."""
        if not self.key_file:
            return None
        return KeyRing.from_files(self.key_file, self.verify_key_files)
