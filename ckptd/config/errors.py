"""What a configuration problem is: one line under the key it concerns.

Every problem the loader finds (a bad value, an unknown key or variable, an unreadable
file) becomes a ``ConfigProblem``; they are raised together as one ``ConfigError``
(exit 2). A model validator that knows a more precise key than the one pydantic reports
raises ``keyed_error``, which ``ckptd.config.translation`` appends to the location.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic_core import PydanticCustomError

from ckptd.core.errors import EXIT_USAGE, CkptdError

__all__ = [
    "KEYED_ERROR",
    "ConfigError",
    "ConfigProblem",
    "did_you_mean",
    "keyed_error",
    "unset_destination",
]


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
KEYED_ERROR = "ckptd_config"


def keyed_error(loc_suffix: tuple[str | int, ...], message: str) -> PydanticCustomError:
    """A validation error about the key ``loc_suffix`` below the validated model."""
    return PydanticCustomError(
        KEYED_ERROR, "{reason}", {"reason": message, "loc_suffix": loc_suffix}
    )


def unset_destination() -> ConfigError:
    """The error of a command that needs a destination when none is configured."""
    return ConfigError(
        "destination.url",
        "is not set; give --dest URL, CKPTD_DESTINATION__URL or [destination] url "
        "(s3://bucket[/prefix], gs://bucket[/prefix], az://container[/prefix] or "
        "file:///absolute/path)",
    )


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest of ``known``, else the list of them."""
    candidates = list(known)
    close = difflib.get_close_matches(name, candidates, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return "; known: " + ", ".join(candidates) if candidates else ""
