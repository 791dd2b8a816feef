"""The ``[peers]`` section: peer replication (``ckptd.peers``; docs/peers.md).

Off by default. Each key carries its description: docs/configuration.md is generated from
this model. The checks that need other sections (many nodes, the watch dirs, the state
dir) are ``Settings``'s (``peers_problem``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from ckptd.config.base import Section, absolute_path, parse_listen
from ckptd.config.errors import keyed_error

__all__ = ["DEFAULT_PEER_PORT", "PeersConfig", "peers_problem", "read_peer_token"]

DEFAULT_PEER_PORT = 9465
#: The most a restore waits for peers before it reads from the store.
RESTORE_WAIT_MAX_SECONDS = 30.0


class PeersConfig(Section):
    """Peer replication: a node's part of an emergency checkpoint, safe on another node."""

    enabled: bool = Field(
        default=False,
        description="Serve the peer port, push each node's part of an emergency checkpoint "
        "to `copies` other nodes of the run, hand a dead node's part off to the store, and "
        "restore from peers first. Needs `cluster.nodes` >= 2, `token_file` and `quota_gib`.",
    )
    listen: str = Field(
        default=f"0.0.0.0:{DEFAULT_PEER_PORT}",
        description="Where the peer port listens (`host:port`). Every request must be "
        "signed with the token; open it to the cluster network only (docs/security.md).",
    )
    advertise: str = Field(
        default="",
        description="The address (`host` or `host:port`) the other nodes reach this one at; "
        "empty = the listen address when it names one, else this node's address on its "
        "route to the store.",
    )
    token_file: str = Field(
        default="",
        description="An absolute path to the cluster's shared secret (the same file on "
        "every node; at least 16 bytes: `openssl rand -hex 32`). Signs every peer request "
        "and acknowledgement; never sent, never printed.",
    )
    dir: Path | None = Field(
        default=None,
        description="Where the replicas of other nodes' parts are kept (absolute); default "
        "`<state.dir>/replicas`. Must be neither a watch dir nor inside or above one.",
    )
    quota_gib: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Disk the replicas may use, GiB; the oldest replica is evicted first to "
        "make room. Size it for `copies` x the largest part another node pushes (a node's "
        "share of the checkpoint), times the replicas worth keeping (docs/peers.md).",
    )
    copies: int = Field(
        default=1,
        ge=1,
        le=8,
        description="Peers each part goes to; the checkpoint counts as safe off the node once "
        "this many acknowledged it verified (or the store committed it).",
    )
    periodic: bool = Field(
        default=False,
        description="Also replicate every routine checkpoint (paced at `rate_mbit`), not "
        "only the emergency one: a replacement node then restores from peers after any "
        "loss.",
    )
    rate_mbit: float = Field(
        default=1000.0,
        ge=0,
        allow_inf_nan=False,
        description="Pace of routine (`periodic`) replication, Mbit/s per node; 0 = "
        "unpaced. Leave the trainer its collective traffic: a few % of the link.",
    )
    emergency_rate_mbit: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Pace of an emergency checkpoint's replication, Mbit/s; 0 = as fast as "
        "the link takes it (the trainer has saved and stopped by then).",
    )
    failure_domain: str = Field(
        default="",
        description="This node's failure domain (a zone, a rack, a placement group): a part "
        "goes to a peer in another one where there is one. Empty = the cloud's zone from its "
        "metadata (`preemption.provider`), when it says.",
    )
    handoff_after_seconds: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="A peer holding a verified replica finishes its origin's store upload "
        "once the origin has not answered for this long and its part is not in the store.",
    )
    restore_wait_seconds: float = Field(
        default=10.0,
        gt=0,
        le=RESTORE_WAIT_MAX_SECONDS,
        allow_inf_nan=False,
        description="How long a restore still takes a peer's answer of what it holds: the "
        "store starts at once on what no peer has named (at most 0.5 s after asking), and a "
        "peer that answers within this serves what the store has not started "
        f"(at most {RESTORE_WAIT_MAX_SECONDS:g}).",
    )
    share_restores: bool = Field(
        default=True,
        description="Nodes of the run restoring the same checkpoint at once (a job replaced "
        "whole) share it: each fetches a share from the store, verified, and reads the rest "
        "from the others over the cluster network (`<run>/.ckptd-sharing/`; the restore "
        "serves its verified files on a port of its own, on `listen`'s host).",
    )
    share_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="The port a restore serves its verified files on while it shares "
        "(`share_restores`), on `listen`'s host: 0, one the kernel picks; a fixed one where "
        "the cluster's network policy opens only named ports. A second restore on the node "
        "at the same time finds it taken and restores without sharing.",
    )
    announce_interval_seconds: float = Field(
        default=30.0,
        ge=1,
        le=3600,
        allow_inf_nan=False,
        description="How often this node's address and free quota are written to the store "
        "(`<run>/.ckptd-peers/node-<rank>.json`); one PUT each.",
    )

    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("advertise")
    @classmethod
    def _advertise_is_host(cls, value: str) -> str:
        if value:
            parse_listen(value if ":" in value.strip("[]") or "]:" in value else f"{value}:1")
        return value

    @field_validator("token_file")
    @classmethod
    def _token_file_is_absolute(cls, value: str) -> str:
        if value and not Path(value).is_absolute():
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    @field_validator("dir")
    @classmethod
    def _dir_is_absolute(cls, value: Path | None) -> Path | None:
        return None if value is None else absolute_path(value)

    @model_validator(mode="after")
    def _enabled_needs(self) -> PeersConfig:
        if self.share_port and self.share_port == parse_listen(self.listen)[1]:
            raise keyed_error(
                ("share_port",),
                f"peers.share_port {self.share_port} is the peer port's (peers.listen): set "
                "another, or 0 for one the kernel picks",
            )
        if not self.enabled:
            return self
        if not self.token_file:
            raise keyed_error(
                ("token_file",),
                "peers need the cluster's token: set peers.token_file to a file holding the "
                "same secret on every node (openssl rand -hex 32 > FILE)",
            )
        if self.quota_gib <= 0:
            raise keyed_error(
                ("quota_gib",),
                "peers need room for other nodes' parts: set peers.quota_gib (GiB, e.g. 2 x "
                "the largest part a node writes)",
            )
        return self

    @property
    def quota_bytes(self) -> int:
        return int(self.quota_gib * 1024**3)

    def replica_dir(self, state_dir: Path) -> Path:
        return self.dir if self.dir is not None else state_dir / "replicas"

    def advertised(self, route_address: str = "") -> str:
        """``host:port`` the other nodes reach this one at (``route_address``: this node's
        address on its route to the store, when the listen address names none)."""
        host, port = parse_listen(self.listen)
        if self.advertise:
            adv = self.advertise
            return (
                adv
                if adv.rpartition(":")[2].isdigit() and not adv.endswith("]")
                else f"{adv}:{port}"
            )
        if host not in ("0.0.0.0", "::", ""):
            return self.listen
        return f"{route_address}:{port}" if route_address else ""


def peers_problem(
    peers: PeersConfig, nodes: int, state_dir: Path, watch_dirs: list[Path]
) -> tuple[str, str] | None:
    """``(key, why)`` when the enabled peers cannot work with the other sections, or None."""
    if not peers.enabled:
        return None
    if nodes < 2:
        return (
            "enabled",
            "peers are the other nodes of the run: set cluster.nodes >= 2 (one daemon per "
            "node), or turn peers off",
        )
    replicas = peers.replica_dir(state_dir).resolve()
    for watch in watch_dirs:
        w = Path(watch).expanduser().resolve()
        if replicas == w or w in replicas.parents or replicas in w.parents:
            return (
                "dir",
                f"{replicas} and the watch dir {w} overlap: replicas of other nodes must never "
                "mix with this node's own checkpoints; choose another peers.dir",
            )
    return None


def read_peer_token(peers: PeersConfig) -> bytes:
    """The cluster's token from ``peers.token_file``; ConfigError (exit 2) naming the key
    when it cannot be read or is too weak to sign with."""
    from ckptd.config.errors import ConfigError

    try:
        token = Path(peers.token_file).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(
            "peers.token_file",
            f"cannot read {peers.token_file} ({exc.strerror or exc}): put the cluster's "
            "shared secret there on every node, readable by the daemon's user",
        ) from None
    if len(token) < 16 or any(c in b" \t\r\n" for c in token):
        raise ConfigError(
            "peers.token_file",
            f"{peers.token_file} must hold one token of at least 16 bytes and no spaces "
            "(openssl rand -hex 32 > FILE)",
        )
    return token
