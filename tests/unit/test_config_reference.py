"""docs/configuration.md is what the settings models generate, and its hand-written
examples are what ckptd does: the annotated example loads, the error lines are ckptd's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ckptd.config import LAUNCHER_NODE_RANK_VARIABLES, ConfigError, Settings, load_settings
from ckptd.config.environment import env_variable_paths
from ckptd.config.reference import (
    ERROR_EXAMPLE,
    ERROR_EXAMPLE_ENVIRONMENT,
    ERROR_EXAMPLE_FILE,
    EXAMPLE,
    PAGE,
    REGENERATE,
    render_reference,
)
from ckptd.core.handoff import TRAINER_VARIABLES

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_md_is_what_the_models_generate() -> None:
    page = ROOT / PAGE
    assert page.exists(), f"{PAGE} is missing: run `{REGENERATE}` from the repository root"
    assert page.read_text() == render_reference(), (
        f"{PAGE} differs from the settings models: run `{REGENERATE}` from the repository "
        "root and commit the result"
    )


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section or list-of-tables field, None for a plain value."""
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def keys(model: type[BaseModel] = Settings, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every key below ``model``, dotted (``tiers.retention.keep_last``), with its field."""
    for name, field in model.model_fields.items():
        inner = section_model(field.annotation)
        if inner is not None:
            yield from keys(inner, f"{prefix}{name}.")
        if prefix:  # Settings' own fields are the sections, not keys
            yield f"{prefix}{name}", field


def test_every_key_has_a_description() -> None:
    undescribed = [key for key, field in keys() if not field.description]
    assert undescribed == [], "add Field(description=...) to these keys"


def test_every_section_key_and_variable_is_in_the_page() -> None:
    page = render_reference()
    for key, _ in keys():
        section, name = key.rsplit(".", 1)
        # Each section's table follows its heading; the key is a row of it.
        heading = re.search(rf"^##+ `\[*{re.escape(section)}\]*`$", page, re.MULTILINE)
        assert heading is not None, f"no heading for [{section}]"
        table = page[heading.end() :].split("\n#", 1)[0]
        assert f"\n| `{name}` |" in table, f"{key} is not in the [{section}] table"
    for variable in env_variable_paths():
        assert f"`{variable}`" in page, variable


def test_the_annotated_example_is_a_valid_configuration(tmp_path: Path) -> None:
    path = tmp_path / "ckptd.toml"
    path.write_text(EXAMPLE)
    settings = load_settings(path, environ={})
    assert settings.watch[0].effective_run_id == "run1"
    assert [tier.name for tier in settings.tiers] == ["archive"]


def test_the_error_example_is_what_ckptd_says(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(ERROR_EXAMPLE_FILE)
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ=ERROR_EXAMPLE_ENVIRONMENT)
    assert str(caught.value) == ERROR_EXAMPLE


def test_every_variable_the_prose_names_exists() -> None:
    # The settings' variables, the example's typo, and the trainer helpers' (passed by).
    known = set(env_variable_paths()) | set(ERROR_EXAMPLE_ENVIRONMENT) | TRAINER_VARIABLES
    named = set(re.findall(r"\bCKPTD_[A-Z0-9_]*[A-Z0-9]\b", render_reference()))
    assert named - known == set()
    for variable in LAUNCHER_NODE_RANK_VARIABLES:
        assert f"`{variable}`" in render_reference()
