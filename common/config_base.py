"""What every config section shares: the error naming a key (``ConfigError``), and enum
fields taking their string values (``coerce_enums``), so a config read from YAML and one
written in Python compare equal."""

from __future__ import annotations

import dataclasses
import functools
import typing
from enum import StrEnum
from typing import Any


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or impossible. Names the dotted key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@functools.cache
def _enum_fields(cls: type) -> dict[str, type[StrEnum]]:
    """The fields of the dataclass ``cls`` typed as one enum (not optional), by name."""
    hints = typing.get_type_hints(cls)
    return {
        field.name: hint
        for field in dataclasses.fields(cls)
        if isinstance(hint := hints.get(field.name), type) and issubclass(hint, StrEnum)
    }


def coerce_enums(obj: Any) -> None:
    """Turn string values of ``obj``'s enum-typed fields into the enum, for frozen
    dataclasses (called from their ``__post_init__``). ``ConfigError`` naming the field
    for a value that is none of the enum's."""
    for name, enum_type in _enum_fields(type(obj)).items():
        value = getattr(obj, name)
        if not isinstance(value, enum_type):
            try:
                object.__setattr__(obj, name, enum_type(value))
            except ValueError:
                choices = ", ".join(member.value for member in enum_type)
                raise ConfigError(name, f"{value!r} is not one of: {choices}") from None
