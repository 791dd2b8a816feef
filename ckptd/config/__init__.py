"""ckptd's settings: the models, how they are loaded, and errors that name the key.

Layers, lowest priority first: defaults < TOML file < ``CKPTD_*`` environment < overrides
(command-line flags). ``load_settings`` is the one way in: it reads each layer, merges them
and validates once, so every problem is reported together, each under the key it concerns.
``Settings()`` on its own reads nothing and gives the defaults.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from signal import Signals
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from ckptd.core.errors import EXIT_USAGE, CkptdError
from ckptd.core.signing import KeyFileError, KeyRing, load_key
from ckptd.storage.url import DestinationKind, DestinationURL, parse_destination

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ENV_PREFIX",
    "LAUNCHER_NODE_RANK_VARIABLES",
    "ClusterConfig",
    "ConfigError",
    "ConfigProblem",
    "DestinationConfig",
    "HttpConfig",
    "Layout",
    "MetricsConfig",
    "PreemptionConfig",
    "Provider",
    "RetentionConfig",
    "Settings",
    "StateConfig",
    "TierConfig",
    "TierRetentionConfig",
    "TrainerConfig",
    "WatchConfig",
    "load_settings",
    "parse_duration",
    "render_effective_config",
    "require_destination",
    "require_watch",
]

DEFAULT_CONFIG_PATH = Path("/etc/ckptd/ckptd.toml")
ENV_PREFIX = "CKPTD_"
ENV_NESTED_DELIMITER = "__"

Layout = Literal[
    "auto", "hf", "dcp", "deepspeed", "megatron", "lightning", "orbax", "marker", "quiescent"
]
Provider = Literal["auto", "aws", "gcp", "azure", "none"]
# What our own SIGTERM means (ckptd.notices.shutdown): a notice, a plain stop, or decided
# by whether the machine or pod is going away.
SigtermMode = Literal["auto", "notice", "stop"]


# --- errors -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with the configuration, under the key it concerns."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class ConfigError(CkptdError):
    """The configuration is invalid (exit 2).

    ``key`` is the first offending key (a dotted path such as ``destination.part_size_mib``
    or ``watch[0].dir``, an environment variable, or a config file path); ``problems`` holds
    every problem found, and ``str()`` gives one line per problem.
    """

    exit_code = EXIT_USAGE

    def __init__(self, key: str, message: str, *, more: Sequence[ConfigProblem] = ()) -> None:
        super().__init__(key, message)
        self.key = key
        self.message = message
        self.problems: tuple[ConfigProblem, ...] = (ConfigProblem(key, message), *more)

    @classmethod
    def from_problems(cls, problems: Sequence[ConfigProblem]) -> ConfigError:
        """One error carrying all ``problems`` (at least one)."""
        first, *rest = problems
        return cls(first.key, first.message, more=rest)

    def __str__(self) -> str:
        return "\n".join(f"invalid config: {problem}" for problem in self.problems)


# A validator that knows a more precise key than the one pydantic reports (a model-level
# check about one field, a list-level check about one entry) raises this error type with
# ``loc_suffix`` in its context; the error translation appends it to the location.
_KEYED_ERROR = "ckptd_config"


def _keyed_error(loc_suffix: tuple[str | int, ...], message: str) -> PydanticCustomError:
    return PydanticCustomError(
        _KEYED_ERROR, "{reason}", {"reason": message, "loc_suffix": loc_suffix}
    )


# --- value checks shared by the models (each raises ValueError with what is wrong) ---------

_TIER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
_RUN_ID_CHARS = re.compile(r"[A-Za-z0-9._=-]+")
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*")
_PORT = re.compile(r"[0-9]{1,5}")


def _run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a remote namespace, or None when it can."""
    # The run id becomes one path segment of every remote key (and, for file://, of a real
    # path), so it must not be able to climb out of or collapse into its parent.
    if not run_id:
        return "must not be empty"
    if not _RUN_ID_CHARS.fullmatch(run_id):
        return "may contain only letters, digits and . _ = -"
    if run_id == "." or ".." in run_id:
        return "must not be '.' or contain '..'"
    return None


def _absolute(path: Path) -> Path:
    try:
        expanded = path.expanduser()
    except RuntimeError as exc:  # "~user" with no such user, or no HOME
        raise ValueError(f"cannot expand '~': {exc}") from None
    if not expanded.is_absolute():
        raise ValueError("must be an absolute path")
    return expanded


def _check_http_url(url: str, *, allow_path: bool) -> None:
    shape = "http(s)://host[:port]" + ("[/path]" if allow_path else "")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"must be {shape} with a port 1..65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be {shape}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not hold credentials (they come from the AWS credential chain)")
    if port == 0:
        raise ValueError(f"must be {shape} with a port 1..65535")
    if parts.query or parts.fragment:
        raise ValueError(f"must be {shape}, without query or fragment")
    if not allow_path and parts.path not in ("", "/"):
        raise ValueError(f"must be {shape}, without a path")


def _parse_listen(listen: str) -> tuple[str, int]:
    """(host, port) of a ``host:port`` / ``[ipv6]:port`` listen address; ValueError if bad."""
    if listen.startswith("["):
        host, sep, port = listen[1:].partition("]:")
        if not sep:
            raise ValueError("must be [ipv6]:port, e.g. [::1]:9464")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    else:
        host, sep, port = listen.rpartition(":")
        if not sep or not host:
            raise ValueError("must be host:port, e.g. 127.0.0.1:9464")
        if ":" in host:
            raise ValueError("must put an IPv6 address in brackets, e.g. [::1]:9464")
        if not _HOSTNAME.fullmatch(host):
            raise ValueError(f"host {host!r} is not a hostname or IPv4 address")
    if not _PORT.fullmatch(port) or int(port) > 65535:
        raise ValueError("port must be a number 0..65535")
    return host, int(port)


# --- models ------------------------------------------------------------------------------


class _Section(BaseModel):
    # Frozen: one validated Settings is shared by every task of the daemon; a change of
    # configuration goes through load_settings (overrides), never through assignment.
    model_config = ConfigDict(extra="forbid", frozen=True)


class WatchConfig(_Section):
    """One local checkpoint root; each direct child is one checkpoint."""

    dir: Path
    run_id: str | None = None
    layout: Layout = "auto"
    quiescence_seconds: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # Quiet window for layouts without a marker file (hf, lightning).
    settle_seconds: float = Field(default=2.0, ge=0, allow_inf_nan=False)
    marker: str = "COMPLETE"
    # Periodic full rescan: file events get lost (NFS, overflowing inotify queues).
    rescan_seconds: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # Send each closed, quiet file before the checkpoint is complete (ckptd.sync.early).
    ship_early: bool = True

    @field_validator("dir")
    @classmethod
    def _dir_is_absolute(cls, value: Path) -> Path:
        return _absolute(value)

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_segment(cls, value: str | None) -> str | None:
        problem = None if value is None else _run_id_problem(value)
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
            problem = _run_id_problem(self.dir.name)
            if problem:
                raise _keyed_error(
                    ("run_id",),
                    f"is unset, and the basename of dir, {self.dir.name!r}, cannot stand in "
                    f"for it: it {problem}; set run_id",
                )
        return self

    @property
    def effective_run_id(self) -> str:
        """The remote namespace: ``run_id``, or the basename of ``dir`` when unset."""
        return self.run_id if self.run_id is not None else self.dir.name


class DestinationConfig(_Section):
    """Where checkpoints go: ``s3://bucket[/prefix]`` or ``file:///abs/path``."""

    url: str = ""
    endpoint_url: str = ""
    region: str = ""
    # S3 multipart limits: parts are 5 MiB..5 GiB (the last part may be smaller).
    part_size_mib: int = Field(default=64, ge=5, le=5120)
    concurrency: int = Field(default=8, ge=1, le=64)
    # Node-wide cap so training I/O is not starved; 0 = unlimited.
    max_upload_mib_per_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    max_attempts: int = Field(default=8, ge=1, le=100)
    # S3 server-side encryption at rest: "" (the bucket's default), SSE-S3 ("AES256")
    # or SSE-KMS ("aws:kms", with an optional key id; the account's default key when "").
    # SSE-C is not offered: S3 blocks it on new buckets since April 2026.
    sse: Literal["", "AES256", "aws:kms"] = ""
    sse_kms_key_id: str = ""
    # The tier's name in metrics, status, `ckptd list` and `restore --tier`.
    name: str = "primary"

    @field_validator("name")
    @classmethod
    def _name_is_a_label(cls, value: str) -> str:
        if not _TIER_NAME.fullmatch(value):
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
            _check_http_url(value, allow_path=False)
        return value

    @model_validator(mode="after")
    def _encryption_fits(self) -> DestinationConfig:
        if self.sse_kms_key_id and self.sse != "aws:kms":
            raise _keyed_error(
                ("sse_kms_key_id",),
                f'is set, but sse is {self.sse!r}: a KMS key applies only with sse = "aws:kms"',
            )
        encrypted = bool(self.sse or self.sse_kms_key_id)
        if encrypted and self.url and parse_destination(self.url).kind != "s3":
            raise _keyed_error(
                ("sse",),
                f"server-side encryption applies to s3:// destinations, not {self.url!r}; "
                "encrypt the filesystem itself, or remove sse",
            )
        return self

    def _parsed(self) -> DestinationURL:
        if not self.url:
            raise _unset_destination()
        return parse_destination(self.url)

    @property
    def kind(self) -> DestinationKind:
        """The scheme, "s3" or "file"; ConfigError (destination.url) when none is set."""
        return self._parsed().kind

    @property
    def bucket(self) -> str:
        """The S3 bucket; ValueError for a file:// destination."""
        parsed = self._parsed()
        if parsed.kind != "s3":
            raise ValueError(f"destination {self.url!r} is not s3://: it has no bucket")
        return parsed.bucket

    @property
    def prefix(self) -> str:
        """The key prefix under the bucket, without leading or trailing '/' ("" for none)."""
        parsed = self._parsed()
        if parsed.kind != "s3":
            raise ValueError(f"destination {self.url!r} is not s3://: it has no prefix")
        return parsed.prefix

    @property
    def root_path(self) -> Path:
        """The root directory of a file:// destination; ValueError for s3://."""
        root = self._parsed().root
        if root is None:
            raise ValueError(f"destination {self.url!r} is not file://: it has no root path")
        return root


_DURATION = re.compile(r"(?P<amount>[0-9]+(?:\.[0-9]+)?)(?P<unit>[smhdw]?)")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit s, m, h, d or w ("7d", "12h",
    "90"); ValueError naming the accepted forms."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise ValueError(
            f"{text!r} is not a duration: write a number and a unit s, m, h, d or w "
            '(e.g. "7d", "12h", "30m"), or "0" for off'
        )
    return float(match["amount"]) * _DURATION_UNITS[match["unit"]]


class TierRetentionConfig(_Section):
    """What one destination keeps (``ckptd.store.retention``): the union of the newest
    ``keep_last`` (0 = no count rule), every step multiple of ``keep_every_steps`` and
    everything committed within ``keep_within``; with no count and no age rule, all."""

    keep_last: int = Field(default=5, ge=0)
    keep_every_steps: int = Field(default=0, ge=0)
    # Age from the manifest's committed_at, e.g. "7d", "12h", "30m"; "0" = off.
    keep_within: str = "0"

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
    """The first destination's retention, and the node's local one (0 = never delete,
    opt-in): local checkpoints are node-wide, so only ``[retention]`` has that key."""

    local_keep_last: int = Field(default=0, ge=0)


class TierConfig(DestinationConfig):
    """One further destination (``[[tiers]]``), committed and retained on its own; the
    same keys as ``[destination]`` (``url`` and ``name`` required) and its own
    ``[tiers.retention]``. Order is restore preference: fastest first."""

    name: str
    url: str
    retention: TierRetentionConfig = Field(default_factory=TierRetentionConfig)

    @field_validator("url")
    @classmethod
    def _url_is_set(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty: s3://bucket[/prefix] or file:///absolute/path")
        return value


class CadenceConfig(_Section):
    """Checkpoint cadence advice (``ckptd.cadence.model``): what overrides the learned figures."""

    # Mean time between interruptions; 0 = learn it from the run's recorded interruptions.
    mtbf_hours: float = Field(default=0.0, ge=0, le=24 * 365, allow_inf_nan=False)
    # Until a run has history, the MTBF assumed (weighted as half an interruption).
    prior_mtbf_hours: float = Field(default=24.0, gt=0, le=24 * 365, allow_inf_nan=False)
    # Interruption records this close together are one interruption (a notice, the
    # restart it causes, the restore on the next node, every node's own notice).
    merge_seconds: float = Field(default=600.0, ge=0, allow_inf_nan=False)
    # Count the interruptions recorded for the other runs under the same destination
    # (their <run>/CADENCE) with the run's own: the rate is mostly the fleet's.
    learn_from_other_runs: bool = True
    min_interval_seconds: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    max_interval_seconds: float = Field(default=6 * 3600.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> CadenceConfig:
        if self.min_interval_seconds > self.max_interval_seconds:
            raise _keyed_error(
                ("min_interval_seconds",),
                f"{self.min_interval_seconds:g} is above max_interval_seconds "
                f"({self.max_interval_seconds:g}); lower it or raise the maximum",
            )
        return self


class PreemptionConfig(_Section):
    """Where preemption notices come from and how often to ask."""

    provider: Provider = "auto"
    # Override of the metadata service base URL (tests, proxies); "" = the provider's own.
    endpoint: str = ""
    poll_interval_seconds: float = Field(default=1.0, gt=0, le=60, allow_inf_nan=False)
    imdsv1_fallback: bool = False
    sigterm: SigtermMode = "auto"

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_http(cls, value: str) -> str:
        if value:
            _check_http_url(value, allow_path=True)
        return value


class TrainerConfig(_Section):
    """How to find the trainer process and which signal tells it to save."""

    pidfile: str = ""
    match: str = ""
    signal: str = "SIGUSR1"

    @field_validator("pidfile")
    @classmethod
    def _pidfile_is_absolute(cls, value: str) -> str:
        # The daemon's working directory is whatever systemd or Docker gave it, so a
        # relative pidfile would silently point somewhere else.
        return str(_absolute(Path(value))) if value else value

    @field_validator("signal")
    @classmethod
    def _signal_is_catchable(cls, value: str) -> str:
        name = value.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in Signals.__members__:
            raise ValueError("must be a signal name such as SIGUSR1, SIGTERM or SIGINT")
        # The signal asks the trainer to save; one it cannot catch would just stop it.
        if name in ("SIGKILL", "SIGSTOP"):
            raise ValueError("must be a signal the trainer can catch (not SIGKILL or SIGSTOP)")
        return name

    @model_validator(mode="after")
    def _one_way_to_find_the_trainer(self) -> TrainerConfig:
        if self.pidfile and self.match:
            raise _keyed_error(("match",), "set trainer.pidfile or trainer.match, not both")
        return self

    @property
    def signal_number(self) -> Signals:
        """``signal`` as a ``signal.Signals`` member."""
        return Signals[self.signal]


class MetricsConfig(_Section):
    """The HTTP listener for /metrics, /healthz and /v1/*."""

    listen: str = "127.0.0.1:9464"

    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, value: str) -> str:
        _parse_listen(value)
        return value

    @property
    def host(self) -> str:
        """The host part of ``listen`` (an IPv6 address without brackets)."""
        return _parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        """The port part of ``listen`` (0 = any free port)."""
        return _parse_listen(self.listen)[1]


class HttpConfig(_Section):
    """Access control for the /v1/* endpoints."""

    # Optional bearer token; a secret, so it is never printed (SecretStr masks it).
    token: SecretStr = SecretStr("")


class StateConfig(_Section):
    """Local state: the journal that makes work resumable after a restart."""

    dir: Path = Path("/var/lib/ckptd")

    @field_validator("dir")
    @classmethod
    def _dir_is_absolute(cls, value: Path) -> Path:
        return _absolute(value)


#: Where launchers put this node's index, tried in order when ``cluster.node_rank`` is not
#: set: torchrun/Lightning (NODE_RANK), torchrun's elastic agent (GROUP_RANK), SkyPilot
#: (SKYPILOT_NODE_RANK), an indexed Kubernetes Job or JobSet (JOB_COMPLETION_INDEX).
LAUNCHER_NODE_RANK_VARIABLES: tuple[str, ...] = (
    "NODE_RANK",
    "GROUP_RANK",
    "SKYPILOT_NODE_RANK",
    "JOB_COMPLETION_INDEX",
)


class ClusterConfig(_Section):
    """Several nodes whose local disks each hold part of every checkpoint."""

    nodes: int = Field(default=1, ge=1, le=4096)
    # None = not configured: load_settings fills it from a launcher's variable, else 0.
    node_rank: int | None = Field(default=None, ge=0)
    # How often a node looks in the store for what the other nodes wrote (announcements,
    # parts, a NOTICE); each look is one LIST or GET per waiting checkpoint.
    poll_interval_seconds: float = Field(default=1.0, gt=0, le=60, allow_inf_nan=False)

    @model_validator(mode="after")
    def _rank_within_nodes(self) -> ClusterConfig:
        if self.node_rank is not None and self.node_rank >= self.nodes:
            raise _keyed_error(
                ("node_rank",),
                f"{self.node_rank} is not below cluster.nodes = {self.nodes}; "
                f"node ranks run from 0 to {self.nodes - 1}",
            )
        return self

    @property
    def rank(self) -> int:
        """This node's rank (0 when neither the config nor a launcher set one)."""
        return self.node_rank or 0

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


class ResourcesConfig(_Section):
    """How the daemon yields to the trainer it shares the node with."""

    # Niceness the daemon moves down to (never up); 0 leaves it as started.
    nice: int = Field(default=19, ge=0, le=19)
    # The transfer threads' CPU scheduling: idle (SCHED_IDLE: they run only when their
    # CPU has nothing else to run; an emergency's transfers run at `nice` instead) or
    # normal (at `nice` always).
    cpu_policy: Literal["idle", "normal"] = "idle"
    # I/O scheduling class: best-effort at io_priority, idle (only when the disk is
    # otherwise unused: may starve under a busy data loader), or none (leave as is).
    io_class: Literal["best-effort", "idle", "none"] = "best-effort"
    # Best-effort level, 0 (first) .. 7 (last).
    io_priority: int = Field(default=7, ge=0, le=7)
    # posix_fadvise(DONTNEED) behind every range read (and file:// written), so
    # shipping does not evict the trainer's dataset from the page cache.
    drop_page_cache: bool = True


class AuthenticationConfig(_Section):
    """Authenticated checkpoints (``ckptd.core.signing``): key files, never keys."""

    # The HMAC key that signs every manifest (and verifies); "" = manifests unsigned.
    key_file: str = ""
    # Older keys still accepted for verification (rotation); each known by its id.
    verify_key_files: list[str] = Field(default_factory=list)

    @field_validator("key_file")
    @classmethod
    def _key_is_usable(cls, value: str) -> str:
        if value:
            _check_key_file(value)
        return value

    @field_validator("verify_key_files")
    @classmethod
    def _keys_are_usable(cls, values: list[str]) -> list[str]:
        for index, value in enumerate(values):
            try:
                _check_key_file(value)
            except ValueError as exc:
                raise _keyed_error((index,), str(exc)) from None
        return values

    @model_validator(mode="after")
    def _verify_needs_a_key(self) -> AuthenticationConfig:
        if self.verify_key_files and not self.key_file:
            raise _keyed_error(
                ("verify_key_files",), "is set without key_file: set key_file (the current key)"
            )
        return self

    def key_ring(self) -> KeyRing | None:
        """The keys, or None when authentication is off."""
        if not self.key_file:
            return None
        return KeyRing.from_files(self.key_file, self.verify_key_files)


def _check_key_file(value: str) -> None:
    if not Path(value).is_absolute():
        raise ValueError(f"must be an absolute path, got {value!r}")
    try:
        load_key(value)
    except KeyFileError as exc:
        raise ValueError(str(exc)) from None


class Settings(BaseSettings):
    """The whole configuration; build it with ``load_settings``."""

    # env_prefix and the nested delimiter define the CKPTD_SECTION__KEY variables that
    # load_settings reads through pydantic-settings' EnvSettingsSource.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        extra="forbid",
        frozen=True,
    )

    watch: list[WatchConfig] = Field(default_factory=list)
    destination: DestinationConfig = Field(default_factory=DestinationConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    cadence: CadenceConfig = Field(default_factory=CadenceConfig)
    authentication: AuthenticationConfig = Field(default_factory=AuthenticationConfig)
    tiers: list[TierConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _tiers_are_distinct(self) -> Settings:
        names = {self.destination.name: "destination"}
        urls = {self.destination.url: "destination"} if self.destination.url else {}
        for index, tier in enumerate(self.tiers):
            if tier.name in names:
                raise _keyed_error(
                    ("tiers", index, "name"),
                    f"{tier.name!r} is already the name of {names[tier.name]}; "
                    "each tier needs its own name",
                )
            key = (tier.url, tier.endpoint_url)
            if tier.url in urls and (self.destination.url, self.destination.endpoint_url) == key:
                raise _keyed_error(
                    ("tiers", index, "url"),
                    f"{tier.url!r} is already the url of {urls[tier.url]}",
                )
            names[tier.name] = f"tiers[{index}]"
            urls.setdefault(tier.url, f"tiers[{index}]")
        if self.tiers and self.cluster.multi_node:
            raise _keyed_error(
                ("tiers",),
                "several tiers are not supported with cluster.nodes > 1 yet: keep "
                "[destination] alone, or run one node",
            )
        return self

    @field_validator("watch")
    @classmethod
    def _watches_are_distinct(cls, watches: list[WatchConfig]) -> list[WatchConfig]:
        dirs: dict[Path, int] = {}
        run_ids: dict[str, int] = {}
        for index, entry in enumerate(watches):
            if entry.dir in dirs:
                raise _keyed_error(
                    (index, "dir"),
                    f"{str(entry.dir)!r} is already watched by watch[{dirs[entry.dir]}]",
                )
            run_id = entry.effective_run_id
            if run_id in run_ids:
                # Two watches in one namespace would overwrite each other's LATEST.
                source = "" if entry.run_id is not None else " (the basename of dir)"
                raise _keyed_error(
                    (index, "run_id"),
                    f"run id {run_id!r}{source} is already used by watch[{run_ids[run_id]}]; "
                    "each watch needs its own run_id",
                )
            dirs[entry.dir] = index
            run_ids[run_id] = index
        return watches

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_settings reads the file and the environment itself (it must name the file or
        # variable behind each problem) and passes the merged result in; Settings reads
        # nothing on its own, so constructing one never depends on the process environment.
        return (init_settings,)


# --- loading -----------------------------------------------------------------------------


def load_settings(
    config_file: Path | str | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Load and validate the configuration; raise ConfigError listing every problem.

    ``config_file`` None means DEFAULT_CONFIG_PATH if it exists, else defaults only.
    Priority: ``overrides`` (nested dicts from CLI flags; a None value means "not given")
    > ``environ`` (default ``os.environ``) > the TOML file > defaults.
    """
    if config_file is not None:
        file_layer = _read_config_file(Path(config_file).expanduser())
    elif DEFAULT_CONFIG_PATH.exists():
        file_layer = _read_config_file(DEFAULT_CONFIG_PATH)
    else:
        file_layer = {}
    environ = os.environ if environ is None else environ
    env = _read_environment(environ)
    override_layer = _without_none(overrides or {})
    merged = _merge(_merge(file_layer, env.layer), override_layer)

    problems = list(env.problems)
    problems += _node_rank_from_launcher(merged, environ)
    # BaseSettings.__init__ takes underscore-prefixed keyword options (_env_file,
    # _cli_parse_args, ...), so a stray top-level key must never reach it as a keyword.
    fields = {name: value for name, value in merged.items() if name in Settings.model_fields}
    problems += [
        ConfigProblem(name, "unknown key" + _suggest(name, Settings.model_fields))
        for name in merged
        if name not in fields
    ]
    settings: Settings | None = None
    try:
        settings = Settings(**fields)
    except ValidationError as exc:
        problems += _translate(exc, env, override_layer)
    if problems or settings is None:
        raise ConfigError.from_problems(problems)
    return settings


def _node_rank_from_launcher(
    merged: dict[str, Any], environ: Mapping[str, str]
) -> list[ConfigProblem]:
    """Fill ``cluster.node_rank`` from the first launcher variable set, when no layer set it.

    Only for a multi-node cluster: on one node a stray NODE_RANK must not matter.
    """
    cluster = merged.get("cluster")
    if cluster is not None and not isinstance(cluster, dict):
        return []  # not a table: validation names the key
    cluster = cluster or {}
    if cluster.get("node_rank") is not None:
        return []
    try:
        nodes = int(cluster.get("nodes", 1))
    except (TypeError, ValueError):
        return []  # validation names cluster.nodes
    if nodes <= 1:
        return []
    for name in LAUNCHER_NODE_RANK_VARIABLES:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        if not raw.isdigit():
            return [ConfigProblem(name, f"{raw!r} is not a node rank (a whole number from 0)")]
        merged["cluster"] = {**cluster, "node_rank": int(raw)}
        return []
    return [
        ConfigProblem(
            "cluster.node_rank",
            f"not set, and none of {', '.join(LAUNCHER_NODE_RANK_VARIABLES)} is in the "
            f"environment; with cluster.nodes = {nodes} each node needs its own rank "
            "(set cluster.node_rank or CKPTD_CLUSTER__NODE_RANK)",
        )
    ]


def require_destination(settings: Settings) -> None:
    """Raise ConfigError (key ``destination.url``) when no destination is configured."""
    if not settings.destination.url:
        raise _unset_destination()


def require_watch(settings: Settings) -> None:
    """Raise ConfigError (key ``watch``) when there is nothing to watch."""
    if not settings.watch:
        raise ConfigError(
            "watch",
            "no directory to watch; add a [[watch]] entry with dir, or give --watch DIR",
        )


def _unset_destination() -> ConfigError:
    return ConfigError(
        "destination.url",
        "is not set; give --dest URL, CKPTD_DESTINATION__URL or [destination] url "
        "(s3://bucket[/prefix] or file:///absolute/path)",
    )


def _read_config_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(str(path), "config file does not exist")
    if not path.is_file():
        raise ConfigError(str(path), "config file is not a regular file")
    try:
        source = TomlConfigSettingsSource(Settings, toml_file=path)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), _toml_syntax_message(exc, path)) from None
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise ConfigError(str(path), f"line {line}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(str(path), f"config file cannot be read: {exc.strerror}") from None
    # The raw table, not source(): the source folds key case (case-insensitive matching
    # is for environment variables), and a TOML key must match exactly to be known.
    return dict(source.toml_data)


_TOML_POSITION = re.compile(r"^(?P<what>.*) \(at line (?P<line>\d+), column (?P<column>\d+)\)$")
_AT_END = " (at end of document)"


def _toml_syntax_message(exc: tomllib.TOMLDecodeError, path: Path) -> str:
    # Python 3.11's TOMLDecodeError has the position only in its message, and says "at end
    # of document" for errors it finds there (an unclosed string): name the last line then.
    text = str(exc)
    match = _TOML_POSITION.match(text)
    if match:
        where = f"line {match['line']}, column {match['column']}"
        text = match["what"]
    elif text.endswith(_AT_END):
        where = f"line {len(path.read_bytes().splitlines()) or 1} (end of file)"
        text = text.removesuffix(_AT_END)
    else:
        return f"TOML syntax error: {text}"
    return f"{where}: TOML syntax error: {text}"


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of os.environ."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(Settings)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # Settings is case-insensitive (the default), so names are matched lower-cased.
        return {name.lower(): value for name, value in self._environ.items()}


@dataclass
class _EnvironmentLayer:
    layer: dict[str, Any]
    # Settings path ("destination",) or ("destination", "url") -> the variable that set it.
    variables: dict[tuple[str, ...], str]
    problems: list[ConfigProblem]


def _env_variable_paths() -> dict[str, tuple[str, ...]]:
    """Every accepted variable name (upper case) and the settings path it sets."""
    paths: dict[str, tuple[str, ...]] = {}
    for name, field in Settings.model_fields.items():
        paths[f"{ENV_PREFIX}{name.upper()}"] = (name,)
        section = field.annotation
        # A section's keys can be set one by one; a list (watch) only as a whole, in JSON.
        if isinstance(section, type) and issubclass(section, BaseModel):
            for key in section.model_fields:
                paths[f"{ENV_PREFIX}{name.upper()}{ENV_NESTED_DELIMITER}{key.upper()}"] = (
                    name,
                    key,
                )
    return paths


def _read_environment(environ: Mapping[str, str]) -> _EnvironmentLayer:
    # pydantic-settings ignores a CKPTD_ variable that names no field (CKPTD_DESTINATON__URL
    # is dropped without a word) and reports an unknown key inside a section without naming
    # the variable. So every CKPTD_ variable is checked here first, and only known ones are
    # handed to EnvSettingsSource, which does the nesting and JSON decoding.
    paths = _env_variable_paths()
    accepted: dict[str, str] = {}
    variables: dict[tuple[str, ...], str] = {}
    problems: list[ConfigProblem] = []
    for name, value in environ.items():
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        path = paths.get(upper)
        if path is None:
            problems.append(ConfigProblem(name, _unknown_variable_message(upper, paths)))
            continue
        if len(path) == 1:
            # Sections and the watch list are JSON; decoding here lets the error name the
            # variable (the value itself is not echoed: it may hold the HTTP token).
            try:
                json.loads(value)
            except ValueError as exc:
                problems.append(ConfigProblem(name, f"must be JSON ({exc})"))
                continue
        accepted[name] = value
        variables[path] = name
    try:
        layer = _MappingEnvSource(accepted)()
    except SettingsError as exc:  # not expected after the checks above; still name the cause
        problems.append(ConfigProblem("environment", str(exc)))
        layer = {}
    return _EnvironmentLayer(layer, variables, problems)


def _unknown_variable_message(upper: str, paths: Mapping[str, tuple[str, ...]]) -> str:
    watch_var = f"{ENV_PREFIX}WATCH"
    if upper.startswith(watch_var + ENV_NESTED_DELIMITER):
        return (
            f"watch entries cannot be set key by key; set {watch_var} to a JSON list, "
            f'e.g. {watch_var}=\'[{{"dir": "/data/ckpt/run1"}}]\''
        )
    key = upper[len(ENV_PREFIX) :].lower().replace(ENV_NESTED_DELIMITER, ".")
    return f"unknown setting: no config key {key!r}" + _suggest(upper, paths)


def _suggest(name: str, known: Iterable[str]) -> str:
    candidates = list(known)
    close = difflib.get_close_matches(name, candidates, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return "; known: " + ", ".join(candidates) if candidates else ""


def _without_none(data: Mapping[str, Any]) -> dict[str, Any]:
    # CLI code passes every flag, None when not given; a missing flag must not mask the
    # environment or the file.
    return {
        key: _without_none(value) if isinstance(value, Mapping) else value
        for key, value in data.items()
        if value is not None
    }


def _merge(lower: Mapping[str, Any], higher: Mapping[str, Any]) -> dict[str, Any]:
    """``higher`` over ``lower``: tables merge key by key; anything else (lists) replaces."""
    merged = dict(lower)
    for key, value in higher.items():
        below = merged.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            merged[key] = _merge(below, value)
        else:
            merged[key] = value
    return merged


# --- turning pydantic's errors into ConfigProblems ---------------------------------------

_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _translate(
    exc: ValidationError, env: _EnvironmentLayer, overrides: Mapping[str, Any]
) -> Iterator[ConfigProblem]:
    for error in exc.errors(include_url=False):
        ctx = error.get("ctx") or {}
        loc = tuple(error["loc"]) + tuple(ctx.get("loc_suffix", ()))
        message = _describe(error, loc) + _got(error, loc)
        # A missing key is reported on the key; where it was missing from is its table.
        origin = tuple(error["loc"])[:-1] if error["type"] == "missing" else tuple(error["loc"])
        yield ConfigProblem(_dotted(loc), message + _env_hint(origin, loc, env, overrides))


def _dotted(loc: tuple[str | int, ...]) -> str:
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key or "(top level)"


def _describe(error: ErrorDetails, loc: tuple[str | int, ...]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "unknown key" + _suggest(str(loc[-1]), _keys_at(loc[:-1]))
    if kind in _BOUNDS:
        op, name = _BOUNDS[kind]
        bound = ctx[name]
        # Float fields carry float bounds; "> 0" reads better than "> 0.0".
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"must be {op} {bound}"
    if kind == "value_error":
        return str(ctx["error"])
    if kind == _KEYED_ERROR:
        return error["msg"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a table"
    if kind == "list_type":
        return f"must be a list of tables: write [[{loc[-1]}]], not [{loc[-1]}]"
    if kind == "finite_number":
        return "must be a finite number"
    if kind.startswith("path_"):
        return "must be a path (a string)"
    text = error["msg"]
    if text.startswith("Input should be"):
        return "must be" + text.removeprefix("Input should be")
    return text[:1].lower() + text[1:]


_URL_CREDENTIALS = re.compile(r"//[^/@\s]*@")


def _got(error: ErrorDetails, loc: tuple[str | int, ...]) -> str:
    value = error["input"]
    if error["type"] in ("missing", "extra_forbidden", _KEYED_ERROR):
        return ""
    if not isinstance(value, str | int | float | Path) or _holds_secret(_annotation_at(loc)):
        return ""  # tables and lists are not echoed, secrets never
    text = repr(str(value)) if isinstance(value, str | Path) else repr(value)
    text = _URL_CREDENTIALS.sub("//***@", text)
    return f" (got {text if len(text) <= 80 else text[:77] + '...'})"


def _env_hint(
    origin: tuple[str | int, ...],
    loc: tuple[str | int, ...],
    env: _EnvironmentLayer,
    overrides: Mapping[str, Any],
) -> str:
    if _has_path(overrides, origin) or not _has_path(env.layer, origin):
        return ""
    names = tuple(part for part in loc[:2] if isinstance(part, str))
    variable = env.variables.get(names) or env.variables.get(names[:1])
    return f" [from {variable}]" if variable else ""


def _has_path(data: Any, loc: tuple[str | int, ...]) -> bool:
    for part in loc:
        if isinstance(part, str):
            found = isinstance(data, Mapping) and part in data
        else:
            found = isinstance(data, list | tuple) and part < len(data)
        if not found:
            return False
        data = data[part]
    return True


def _annotation_at(loc: tuple[str | int, ...]) -> Any:
    """The type annotation of the settings key at ``loc`` (None if there is none)."""
    annotation: Any = Settings
    for part in loc:
        if isinstance(part, int):
            continue  # a list index: the element type was taken with the list's field
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        field = annotation.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        if get_origin(annotation) is list:
            (annotation,) = get_args(annotation)
    return annotation


def _keys_at(loc: tuple[str | int, ...]) -> list[str]:
    model = _annotation_at(loc)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _holds_secret(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return any(_holds_secret(field.annotation) for field in annotation.model_fields.values())
    return any(_holds_secret(arg) for arg in get_args(annotation))


# --- rendering ---------------------------------------------------------------------------


def render_effective_config(settings: Settings) -> str:
    """The effective configuration as TOML; loading it back gives the same settings,
    except that a set http.token reads back as its mask "***"."""
    lines = [
        "# ckptd effective configuration: defaults, config file, CKPTD_* environment and",
        '# command-line flags merged. Secrets are shown as "***".',
        "",
    ]
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, list):
            if not value:
                lines += [f"# no [[{name}]] entries", ""]
            for entry in value:
                lines += [f"[[{name}]]", *_render_table(entry)]
                if isinstance(entry, WatchConfig) and entry.run_id is None:
                    run_id = _toml_string(entry.effective_run_id)
                    lines.append(f"# run_id unset: defaults to {run_id} (basename of dir)")
                for key in type(entry).model_fields:  # sub-tables: [tiers.retention]
                    inner = getattr(entry, key)
                    if isinstance(inner, BaseModel):
                        lines += [f"[{name}.{key}]", *_render_table(inner)]
                lines.append("")
        else:
            lines += [f"[{name}]", *_render_table(value), ""]
    return "\n".join(lines)


def _render_table(model: BaseModel) -> list[str]:
    lines = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if value is None:  # TOML has no null: leaving the key out means the same
            continue
        if isinstance(value, BaseModel):
            continue  # rendered as its own sub-table after the table's keys
        line = f"{name} = {_toml_value(value)}"
        if isinstance(value, SecretStr) and value.get_secret_value():
            line += "  # redacted"
        lines.append(line)
    return lines


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # finite: the models reject inf and nan
    if isinstance(value, SecretStr):
        return _toml_string("***" if value.get_secret_value() else "")
    if isinstance(value, str | Path):
        return _toml_string(str(value))
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")


def _toml_string(text: str) -> str:
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'
