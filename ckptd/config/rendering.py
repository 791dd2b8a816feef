"""The effective configuration as TOML, for ``ckptd config check``.

Loading the rendered text back gives the same settings, except that a set secret
(``http.token``) reads back as its mask ``"***"``: secrets are never echoed.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, SecretStr

from ckptd.config.settings import Settings
from ckptd.config.shipping import WatchConfig

__all__ = ["render_effective_config", "toml_string", "toml_value"]


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
                    run_id = toml_string(entry.effective_run_id)
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
        line = f"{name} = {toml_value(value)}"
        if isinstance(value, SecretStr) and value.get_secret_value():
            line += "  # redacted"
        lines.append(line)
    return lines


def toml_value(value: object) -> str:
    """``value`` written as TOML (a secret as its mask)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # finite: the models reject inf and nan
    if isinstance(value, SecretStr):
        return toml_string("***" if value.get_secret_value() else "")
    if isinstance(value, str | Path):
        return toml_string(str(value))
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string, control characters escaped."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'
