"""ckptd's settings: the models, how they are loaded, and errors that name the key.

Layers, lowest priority first: defaults < TOML file < ``CKPTD_*`` environment < overrides
(command-line flags). ``load_settings`` is the one way in: it reads each layer, merges them
and validates once, so every problem is reported together, each under the key it concerns.
``Settings()`` on its own reads nothing and gives the defaults.

The package re-exports what callers use; each name lives in one module:

- ``errors``: ``ConfigProblem``, ``ConfigError`` (exit 2), the "did you mean";
- ``base``: the sections' frozen base and shared value checks (``parse_duration``);
- ``shipping``: ``[[watch]]``, ``[destination]``, ``[retention]``, ``[[tiers]]``,
  ``[authentication]``;
- ``node``: ``[preemption]``, ``[trainer]``, ``[cluster]``, ``[resources]``,
  ``[cadence]``, ``[metrics]``, ``[http]``, ``[state]``;
- ``drill``: ``[drill]``;
- ``settings``: ``Settings``, the whole, and the checks across sections;
- ``environment``: the ``CKPTD_*`` layer; ``loading``: ``load_settings``;
- ``translation``: pydantic's errors as one line per key;
- ``rendering``: the effective configuration as TOML (``ckptd config check``);
- ``reference``: docs/configuration.md, generated from the models.
"""

from __future__ import annotations

from ckptd.config.base import parse_duration
from ckptd.config.errors import ConfigError, ConfigProblem
from ckptd.config.loading import (
    DEFAULT_CONFIG_PATH,
    load_settings,
    require_destination,
    require_watch,
)
from ckptd.config.node import (
    LAUNCHER_JOB_ID_VARIABLES,
    LAUNCHER_NODE_RANK_VARIABLES,
    CadenceConfig,
    ClusterConfig,
    HttpConfig,
    MetricsConfig,
    PreemptionConfig,
    Provider,
    ResourcesConfig,
    SigtermMode,
    StateConfig,
    TrainerConfig,
)
from ckptd.config.rendering import render_effective_config
from ckptd.config.settings import ENV_PREFIX, Settings
from ckptd.config.shipping import (
    AuthenticationConfig,
    DestinationConfig,
    Layout,
    RetentionConfig,
    TierConfig,
    TierRetentionConfig,
    WatchConfig,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ENV_PREFIX",
    "LAUNCHER_JOB_ID_VARIABLES",
    "LAUNCHER_NODE_RANK_VARIABLES",
    "AuthenticationConfig",
    "CadenceConfig",
    "ClusterConfig",
    "ConfigError",
    "ConfigProblem",
    "DestinationConfig",
    "HttpConfig",
    "Layout",
    "MetricsConfig",
    "PreemptionConfig",
    "Provider",
    "ResourcesConfig",
    "RetentionConfig",
    "Settings",
    "SigtermMode",
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
