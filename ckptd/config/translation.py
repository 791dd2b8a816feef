"""Pydantic's validation errors, translated into one line each under the key they concern.

A line says what is wrong, what was given (never a secret, never a URL's credentials),
the closest known key for an unknown one ("did you mean"), and the ``CKPTD_*`` variable
when the bad value came from the environment.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic_core import ErrorDetails

from ckptd.config.environment import EnvironmentLayer
from ckptd.config.errors import KEYED_ERROR, ConfigProblem, did_you_mean
from ckptd.config.settings import Settings

__all__ = ["translate"]

_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def translate(
    exc: ValidationError, env: EnvironmentLayer, overrides: Mapping[str, Any]
) -> Iterator[ConfigProblem]:
    """One ConfigProblem per error in ``exc``, under its dotted key."""
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
        return "unknown key" + did_you_mean(str(loc[-1]), _keys_at(loc[:-1]))
    if kind in _BOUNDS:
        op, name = _BOUNDS[kind]
        bound = ctx[name]
        # Float fields carry float bounds; "> 0" reads better than "> 0.0".
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"must be {op} {bound}"
    if kind == "value_error":
        return str(ctx["error"])
    if kind == KEYED_ERROR:
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
    if error["type"] in ("missing", "extra_forbidden", KEYED_ERROR):
        return ""
    if not isinstance(value, str | int | float | Path) or _holds_secret(_annotation_at(loc)):
        return ""  # tables and lists are not echoed, secrets never
    text = repr(str(value)) if isinstance(value, str | Path) else repr(value)
    text = _URL_CREDENTIALS.sub("//***@", text)
    return f" (got {text if len(text) <= 80 else text[:77] + '...'})"


def _env_hint(
    origin: tuple[str | int, ...],
    loc: tuple[str | int, ...],
    env: EnvironmentLayer,
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
