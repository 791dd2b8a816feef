"""``Settings``: the whole configuration, one field per section, and the checks that span
sections (distinct watches, distinct tiers).

``Settings()`` on its own reads nothing and gives the defaults; ``load_settings``
(``ckptd.config.loading``) reads the layers and passes their merge in.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ckptd.config.drill import DrillConfig
from ckptd.config.errors import keyed_error
from ckptd.config.health import HealthConfig
from ckptd.config.node import (
    CadenceConfig,
    ClusterConfig,
    HttpConfig,
    MetricsConfig,
    PreemptionConfig,
    ResourcesConfig,
    StateConfig,
    TrainerConfig,
)
from ckptd.config.peers import PeersConfig, peers_problem
from ckptd.config.shipping import (
    AuthenticationConfig,
    DestinationConfig,
    RetentionConfig,
    TierConfig,
    WatchConfig,
)
from ckptd.config.slurm import SlurmConfig

__all__ = ["ENV_NESTED_DELIMITER", "ENV_PREFIX", "Settings"]

ENV_PREFIX = "CKPTD_"
ENV_NESTED_DELIMITER = "__"


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
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    drill: DrillConfig = Field(default_factory=DrillConfig)
    peers: PeersConfig = Field(default_factory=PeersConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    tiers: list[TierConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _peers_fit(self) -> Settings:
        problem = peers_problem(
            self.peers, self.cluster.nodes, self.state.dir, [w.dir for w in self.watch]
        )
        if problem is not None:
            raise keyed_error(("peers", problem[0]), problem[1])
        return self

    @model_validator(mode="after")
    def _tiers_are_distinct(self) -> Settings:
        names = {self.destination.name: "destination"}
        urls = {self.destination.url: "destination"} if self.destination.url else {}
        for index, tier in enumerate(self.tiers):
            if tier.name in names:
                raise keyed_error(
                    ("tiers", index, "name"),
                    f"{tier.name!r} is already the name of {names[tier.name]}; "
                    "each tier needs its own name",
                )
            key = (tier.url, tier.endpoint_url)
            if tier.url in urls and (self.destination.url, self.destination.endpoint_url) == key:
                raise keyed_error(
                    ("tiers", index, "url"),
                    f"{tier.url!r} is already the url of {urls[tier.url]}",
                )
            names[tier.name] = f"tiers[{index}]"
            urls.setdefault(tier.url, f"tiers[{index}]")
        if self.tiers and self.cluster.multi_node:
            raise keyed_error(
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
                raise keyed_error(
                    (index, "dir"),
                    f"{str(entry.dir)!r} is already watched by watch[{dirs[entry.dir]}]",
                )
            run_id = entry.effective_run_id
            if run_id in run_ids:
                # Two watches in one namespace would overwrite each other's LATEST.
                source = "" if entry.run_id is not None else " (the basename of dir)"
                raise keyed_error(
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
