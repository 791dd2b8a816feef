"""The ``CKPTD_*`` environment layer: which variables exist, and reading them so that
every problem names the variable behind it.

A section's key is ``CKPTD_<SECTION>__<KEY>`` (``CKPTD_DESTINATION__URL``); a whole
section, or a list (``CKPTD_WATCH``, ``CKPTD_TIERS``), is one variable holding JSON.
Values are never echoed: one may be the HTTP token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_settings import EnvSettingsSource, SettingsError

from ckptd.config.errors import ConfigProblem, did_you_mean
from ckptd.config.settings import ENV_NESTED_DELIMITER, ENV_PREFIX, Settings
from ckptd.core.handoff import TRAINER_VARIABLES

__all__ = ["EnvironmentLayer", "env_variable_paths", "read_environment"]


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of os.environ."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(Settings)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # Settings is case-insensitive (the default), so names are matched lower-cased.
        return {name.lower(): value for name, value in self._environ.items()}


@dataclass
class EnvironmentLayer:
    """What the ``CKPTD_*`` variables set, which variable set what, and what was wrong."""

    layer: dict[str, Any]
    # Settings path ("destination",) or ("destination", "url") -> the variable that set it.
    variables: dict[tuple[str, ...], str]
    problems: list[ConfigProblem]


def env_variable_paths() -> dict[str, tuple[str, ...]]:
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


def read_environment(environ: Mapping[str, str]) -> EnvironmentLayer:
    """The settings the ``CKPTD_*`` variables of ``environ`` give, each checked first."""
    # pydantic-settings ignores a CKPTD_ variable that names no field (CKPTD_DESTINATON__URL
    # is dropped without a word) and reports an unknown key inside a section without naming
    # the variable. So every CKPTD_ variable is checked here first, and only known ones are
    # handed to EnvSettingsSource, which does the nesting and JSON decoding.
    paths = env_variable_paths()
    accepted: dict[str, str] = {}
    variables: dict[tuple[str, ...], str] = {}
    problems: list[ConfigProblem] = []
    for name, value in environ.items():
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in TRAINER_VARIABLES:
            continue  # not ckptd's, or the trainer helpers' (exec passes them on)
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
    return EnvironmentLayer(layer, variables, problems)


def _unknown_variable_message(upper: str, paths: Mapping[str, tuple[str, ...]]) -> str:
    watch_var = f"{ENV_PREFIX}WATCH"
    if upper.startswith(watch_var + ENV_NESTED_DELIMITER):
        return (
            f"watch entries cannot be set key by key; set {watch_var} to a JSON list, "
            f'e.g. {watch_var}=\'[{{"dir": "/data/ckpt/run1"}}]\''
        )
    key = upper[len(ENV_PREFIX) :].lower().replace(ENV_NESTED_DELIMITER, ".")
    return f"unknown setting: no config key {key!r}" + did_you_mean(upper, paths)
