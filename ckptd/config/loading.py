"""``load_settings``: the layers read, merged and validated once.

Layers, lowest priority first: defaults < TOML file < ``CKPTD_*`` environment < overrides
(command-line flags). Tables merge key by key; a list replaces the one below. Every
problem of every layer is reported together, each under the key it concerns.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import TomlConfigSettingsSource

from ckptd.config.environment import read_environment
from ckptd.config.errors import ConfigError, ConfigProblem, did_you_mean, unset_destination
from ckptd.config.node import LAUNCHER_JOB_ID_VARIABLES, LAUNCHER_NODE_RANK_VARIABLES
from ckptd.config.settings import Settings
from ckptd.config.translation import translate

__all__ = ["DEFAULT_CONFIG_PATH", "load_settings", "require_destination", "require_watch"]

DEFAULT_CONFIG_PATH = Path("/etc/ckptd/ckptd.toml")


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
    env = read_environment(environ)
    override_layer = _without_none(overrides or {})
    below = _merge(file_layer, env.layer)
    override_layer = _watch_over(below, override_layer)
    merged = _merge(below, override_layer)

    problems = list(env.problems)
    problems += _node_rank_from_launcher(merged, environ)
    _job_id_from_launcher(merged, environ)
    # BaseSettings.__init__ takes underscore-prefixed keyword options (_env_file,
    # _cli_parse_args, ...), so a stray top-level key must never reach it as a keyword.
    fields = {name: value for name, value in merged.items() if name in Settings.model_fields}
    problems += [
        ConfigProblem(name, "unknown key" + did_you_mean(name, Settings.model_fields))
        for name in merged
        if name not in fields
    ]
    settings: Settings | None = None
    try:
        settings = Settings(**fields)
    except ValidationError as exc:
        problems += translate(exc, env, override_layer)
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


def _job_id_from_launcher(merged: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Fill ``cluster.job_id`` from the first launcher variable set, when no layer set it
    (a multi-node cluster only). Slurm keeps a job's id across a requeue: a restarted one
    (``SLURM_RESTART_COUNT`` above 0) is ``<id>.r<count>``, another job than the attempt
    before it, which may still be running beside it. torchrun's default rendezvous id
    ``none`` names no job. None set: left unset (``ckptd.sync.claims.cluster_writer``)."""
    cluster = merged.get("cluster")
    if cluster is not None and not isinstance(cluster, dict):
        return
    cluster = cluster or {}
    if cluster.get("job_id") is not None:
        return
    try:
        if int(cluster.get("nodes", 1)) <= 1:
            return
    except (TypeError, ValueError):
        return
    for name in LAUNCHER_JOB_ID_VARIABLES:
        raw = environ.get(name, "").strip()
        if not raw or (name == "TORCHELASTIC_RUN_ID" and raw == "none"):
            continue
        if name == "SLURM_JOB_ID":
            restarts = environ.get("SLURM_RESTART_COUNT", "").strip()
            if restarts.isdigit() and int(restarts) > 0:
                raw = f"{raw}.r{int(restarts)}"
        merged["cluster"] = {**cluster, "job_id": raw}
        return


def require_destination(settings: Settings) -> None:
    """Raise ConfigError (key ``destination.url``) when no destination is configured."""
    if not settings.destination.url:
        raise unset_destination()


def require_watch(settings: Settings) -> None:
    """Raise ConfigError (key ``watch``) when there is nothing to watch."""
    if not settings.watch:
        raise ConfigError(
            "watch",
            "no directory to watch; add a [[watch]] entry with dir, or give --watch DIR",
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


def _without_none(data: Mapping[str, Any]) -> dict[str, Any]:
    # CLI code passes every flag, None when not given; a missing flag must not mask the
    # environment or the file.
    return {
        key: _without_none(value) if isinstance(value, Mapping) else value
        for key, value in data.items()
        if value is not None
    }


def _watch_over(below: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` with its ``--watch`` entry completed by the file's (or the
    environment's) ``[[watch]]`` entry for the same directory: ``--watch DIR`` keeps that
    entry's settings (``layout``, ``run_id``, ...), the flags' own over them. The list
    still replaces the lower one: other directories are not watched."""
    out = dict(overrides)
    given, lower = overrides.get("watch"), below.get("watch")
    if not (isinstance(given, list) and len(given) == 1 and isinstance(lower, list)):
        return out
    entry = given[0]
    if not isinstance(entry, Mapping) or not isinstance(entry.get("dir"), str):
        return out
    wanted = Path(entry["dir"]).expanduser().absolute()
    for candidate in lower:
        if not isinstance(candidate, Mapping) or not isinstance(candidate.get("dir"), str):
            continue
        if Path(candidate["dir"]).expanduser().absolute() == wanted:
            out["watch"] = [{**candidate, **entry}]
            break
    return out


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
