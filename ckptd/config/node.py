"""The sections about the daemon on its node: ``[preemption]``, ``[trainer]``,
``[cluster]``, ``[resources]``, ``[cadence]``, ``[metrics]``, ``[http]`` and ``[state]``.

Each key carries its description (``Field(description=...)``): docs/configuration.md is
generated from these models (``python -m ckptd.config.reference``), so the wording lives
here and nowhere else.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from signal import Signals
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from ckptd.config.base import Section, absolute_path, check_http_url, parse_listen
from ckptd.config.errors import keyed_error

__all__ = [
    "CONTROL_SOCKET_NAME",
    "LAUNCHER_JOB_ID_VARIABLES",
    "LAUNCHER_NODE_RANK_VARIABLES",
    "CadenceConfig",
    "ClusterConfig",
    "HttpConfig",
    "MetricsConfig",
    "PreemptionConfig",
    "Provider",
    "ResourcesConfig",
    "SigtermMode",
    "StateConfig",
    "TrainerConfig",
    "is_loopback",
]

Provider = Literal["auto", "aws", "gcp", "azure", "none"]
# What our own SIGTERM means (ckptd.notices.shutdown): a notice, a plain stop, or decided
# by whether the machine or pod is going away.
SigtermMode = Literal["auto", "notice", "stop"]


class PreemptionConfig(Section):
    """Where preemption notices come from and how often to ask."""

    provider: Provider = Field(
        default="auto",
        description="The cloud whose metadata service announces preemptions; `auto` "
        "detects it from `/sys/class/dmi/id` and never blocks start-up; `none` = no cloud.",
    )
    endpoint: str = Field(
        default="",
        description="Override of the metadata service's base URL (tests, proxies); "
        "empty = the provider's own.",
    )
    poll_interval_seconds: float = Field(
        default=1.0,
        gt=0,
        le=60,
        allow_inf_nan=False,
        description="How often the metadata service is asked.",
    )
    imdsv1_fallback: bool = Field(
        default=False,
        description="AWS: read the metadata without an IMDSv2 token when the token request "
        "fails (a container behind a bridge, where the hop limit of 1 stops the PUT).",
    )
    sigterm: SigtermMode = Field(
        default="auto",
        description="What the daemon's own SIGTERM means: `notice` (save, as for a cloud "
        "notice), `stop` (a plain stop; training goes on), or `auto` (a notice when the "
        "machine or pod is going away).",
    )

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_http(cls, value: str) -> str:
        if value:
            check_http_url(value, allow_path=True)
        return value


class TrainerConfig(Section):
    """How to find the trainer process and which signal tells it to save."""

    pidfile: str = Field(
        default="",
        description="An absolute path to a file holding the trainer's PID; or set `match`.",
    )
    match: str = Field(
        default="",
        description="Text of the trainer's command line (e.g. `train.py`): every matching "
        "process (all ranks on the node) is signalled; or set `pidfile`.",
    )
    signal: str = Field(
        default="SIGUSR1",
        description="The signal that asks the trainer to save (one it can catch: not "
        "SIGKILL or SIGSTOP).",
    )

    @field_validator("pidfile")
    @classmethod
    def _pidfile_is_absolute(cls, value: str) -> str:
        # The daemon's working directory is whatever systemd or Docker gave it, so a
        # relative pidfile would silently point somewhere else.
        return str(absolute_path(Path(value))) if value else value

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
            raise keyed_error(("match",), "set trainer.pidfile or trainer.match, not both")
        return self

    @property
    def signal_number(self) -> Signals:
        """``signal`` as a ``signal.Signals`` member."""
        return Signals[self.signal]


#: Where launchers put this node's index, tried in order when ``cluster.node_rank`` is not
#: set: torchrun/Lightning (NODE_RANK), torchrun's elastic agent (GROUP_RANK), SkyPilot
#: (SKYPILOT_NODE_RANK), an indexed Kubernetes Job or JobSet (JOB_COMPLETION_INDEX), and
#: last Slurm's node index within the job (SLURM_NODEID, set by srun for each task).
LAUNCHER_NODE_RANK_VARIABLES: tuple[str, ...] = (
    "NODE_RANK",
    "GROUP_RANK",
    "SKYPILOT_NODE_RANK",
    "JOB_COMPLETION_INDEX",
    "SLURM_NODEID",
)


#: Where launchers put the job's id, the same on every node of one job and different for
#: another job, tried in order when ``cluster.job_id`` is not set: Slurm (SLURM_JOB_ID,
#: with SLURM_RESTART_COUNT appended once a requeued job restarts: a requeue keeps the
#: id), torchrun's rendezvous id (TORCHELASTIC_RUN_ID, but its default ``none``) and
#: SkyPilot (SKYPILOT_TASK_ID). Two jobs of one run id are told apart by it
#: (``ckptd.sync.claims.cluster_writer``).
LAUNCHER_JOB_ID_VARIABLES: tuple[str, ...] = (
    "SLURM_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "SKYPILOT_TASK_ID",
)


class ClusterConfig(Section):
    """Several nodes whose local disks each hold part of every checkpoint."""

    nodes: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Nodes whose local disks each hold part of every checkpoint; one "
        "daemon runs on each.",
    )
    # None = not configured: load_settings fills it from a launcher's variable, else 0.
    node_rank: int | None = Field(
        default=None,
        ge=0,
        description="This node, 0 .. nodes-1; when unset (and nodes > 1) taken from "
        + ", ".join(LAUNCHER_NODE_RANK_VARIABLES[:-1])
        + f" or {LAUNCHER_NODE_RANK_VARIABLES[-1]}, the first one set.",
    )
    # None = not configured: load_settings fills it from a launcher's variable, if any.
    job_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="The job these nodes are (with nodes > 1): the same on every node of "
        "one job, another for any other job, a relaunch included. Every node of a job "
        "ships a save into one slot as the writer `cluster-<nodes>-<job_id>`; another job "
        "of the same run id is another writer and never shares it. When unset, taken from "
        + ", ".join(LAUNCHER_JOB_ID_VARIABLES[:-1])
        + f" or {LAUNCHER_JOB_ID_VARIABLES[-1]}, the first one set (Slurm's with "
        "`SLURM_RESTART_COUNT` once requeued); with none, every job of the run id is the "
        "one writer `cluster-<nodes>`, and two jobs saving the same name at once cannot be "
        "told apart (docs/many-nodes.md).",
    )
    poll_interval_seconds: float = Field(
        default=1.0,
        gt=0,
        le=60,
        allow_inf_nan=False,
        description="How often a node looks in the store for what the other nodes wrote "
        "(announcements, parts, a NOTICE); each look is one LIST or GET per waiting "
        "checkpoint.",
    )

    @model_validator(mode="after")
    def _rank_within_nodes(self) -> ClusterConfig:
        if self.node_rank is not None and self.node_rank >= self.nodes:
            raise keyed_error(
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


class ResourcesConfig(Section):
    """How the daemon yields to the trainer it shares the node with."""

    nice: int = Field(
        default=19,
        ge=0,
        le=19,
        description="The niceness the daemon moves down to (never up); 0 = as started.",
    )
    cpu_policy: Literal["idle", "normal"] = Field(
        default="idle",
        description="The transfer threads' CPU scheduling: `idle` (SCHED_IDLE: they run "
        "only when their CPU has nothing else to run; an emergency's transfers run at "
        "`nice` instead) or `normal` (at `nice` always).",
    )
    io_class: Literal["best-effort", "idle", "none"] = Field(
        default="best-effort",
        description="I/O scheduling class: `best-effort` at `io_priority`, `idle` (only "
        "when the disk is otherwise unused: may starve under a busy data loader), or `none` "
        "(leave as is).",
    )
    io_priority: int = Field(
        default=7, ge=0, le=7, description="Best-effort level, 0 (first) .. 7 (last)."
    )
    drop_page_cache: bool = Field(
        default=True,
        description="`posix_fadvise(DONTNEED)` behind every range read (and file:// "
        "write), so shipping does not evict the trainer's dataset from the page cache.",
    )


class CadenceConfig(Section):
    """Checkpoint cadence advice (``ckptd.cadence.model``): what overrides the learned figures."""

    mtbf_hours: float = Field(
        default=0.0,
        ge=0,
        le=24 * 365,
        allow_inf_nan=False,
        description="Mean time between interruptions; 0 = learn it from the recorded "
        "interruptions.",
    )
    prior_mtbf_hours: float = Field(
        default=24.0,
        gt=0,
        le=24 * 365,
        allow_inf_nan=False,
        description="The MTBF assumed until a run has history (weighted as half an interruption).",
    )
    merge_seconds: float = Field(
        default=600.0,
        ge=0,
        allow_inf_nan=False,
        description="Interruption records this close together are one interruption (a "
        "notice, the restart it causes, the restore on the next node, every node's own "
        "notice).",
    )
    learn_from_other_runs: bool = Field(
        default=True,
        # The rate is mostly the fleet's: the same instance types in the same zones.
        description="Count the interruptions recorded for the other runs under the same "
        "destination (their `<run>/CADENCE`) with the run's own.",
    )
    min_interval_seconds: float = Field(
        default=60.0,
        ge=0,
        allow_inf_nan=False,
        description="The shortest interval advised; at most `max_interval_seconds`.",
    )
    max_interval_seconds: float = Field(
        default=6 * 3600.0,
        gt=0,
        allow_inf_nan=False,
        description="The longest interval advised.",
    )

    @model_validator(mode="after")
    def _bounds_in_order(self) -> CadenceConfig:
        if self.min_interval_seconds > self.max_interval_seconds:
            raise keyed_error(
                ("min_interval_seconds",),
                f"{self.min_interval_seconds:g} is above max_interval_seconds "
                f"({self.max_interval_seconds:g}); lower it or raise the maximum",
            )
        return self


class MetricsConfig(Section):
    """The scrape listener: /metrics, /healthz, /readyz and /v1/preemption."""

    listen: str = Field(
        default="127.0.0.1:9464",
        description="`host:port` or `[ipv6]:port` of the scrape listener (/metrics, "
        "/healthz, /readyz, /v1/preemption); loopback by default; port 0 = any free port. "
        "The control API (/v1/status, /v1/drill, /v1/advice) is served here too only on "
        "loopback or with an `[http]` token.",
    )

    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, value: str) -> str:
        parse_listen(value)
        return value

    @property
    def host(self) -> str:
        """The host part of ``listen`` (an IPv6 address without brackets)."""
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        """The port part of ``listen`` (0 = any free port)."""
        return parse_listen(self.listen)[1]

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach the listener."""
        return is_loopback(self.host)


#: The control socket's name under ``state.dir`` when ``http.listen`` is empty.
CONTROL_SOCKET_NAME = "ckptd.sock"


class HttpConfig(Section):
    """The control and status API (/v1/status, /v1/drill, /v1/advice), and its token."""

    listen: str = Field(
        default="",
        description="Where the control and status API listens: empty = the Unix socket "
        f"`<state.dir>/{CONTROL_SOCKET_NAME}` (mode 0600: the daemon's user and root "
        "only), `unix:/absolute/path`, or `host:port` (anything but loopback needs "
        "`token_file` or `token`). `ckptd status`, `drill` and `exec` find it here.",
    )
    # A secret, so it is never printed (SecretStr masks it).
    token: SecretStr = Field(
        default=SecretStr(""),
        description="Bearer token: when set (or `token_file`), the control API on a TCP "
        "listener requires `Authorization: Bearer <token>`; the Unix socket is guarded by "
        "its file mode instead. Never printed; prefer `token_file`.",
    )
    token_file: str = Field(
        default="",
        description="An absolute path to a file holding the token (a Kubernetes Secret "
        "mounted as a file); under systemd a `LoadCredential=` of the same file name, in "
        "`$CREDENTIALS_DIRECTORY`, is read in its place. Read by the daemon and the CLI; "
        "never printed.",
    )

    @field_validator("listen")
    @classmethod
    def _listen_is_socket_or_host_port(cls, value: str) -> str:
        if value.startswith("unix:"):
            if not Path(value[5:]).is_absolute():
                raise ValueError("must be unix:/absolute/path, or host:port")
        elif value:
            parse_listen(value)
        return value

    @field_validator("token_file")
    @classmethod
    def _token_file_is_absolute(cls, value: str) -> str:
        if value and not Path(value).is_absolute():
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    @model_validator(mode="after")
    def _remote_control_needs_a_token(self) -> HttpConfig:
        if self.token_file and self.token.get_secret_value():
            raise keyed_error(("token_file",), "set http.token_file or http.token, not both")
        tcp = self.listen and not self.listen.startswith("unix:")
        if tcp and not is_loopback(parse_listen(self.listen)[0]) and not self.has_token:
            raise keyed_error(
                ("listen",),
                f"{self.listen} would let anyone who reaches it stop training (POST "
                "/v1/drill) and read the store's status: set http.token_file (or "
                "http.token), or listen on loopback or a Unix socket (empty = "
                f"<state.dir>/{CONTROL_SOCKET_NAME})",
            )
        return self

    @property
    def has_token(self) -> bool:
        return bool(self.token.get_secret_value() or self.token_file)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StateConfig(Section):
    """Local state: the journal that makes work resumable after a restart."""

    dir: Path = Field(
        default=Path("/var/lib/ckptd"),
        description="Local state (absolute): the journal of finished parts that makes "
        "work resumable after a restart, and each tier's own under `tiers/NAME`.",
    )

    @field_validator("dir")
    @classmethod
    def _dir_is_absolute(cls, value: Path) -> Path:
        return absolute_path(value)
