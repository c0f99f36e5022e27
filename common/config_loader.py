"""Build frozen config dataclasses from YAML-shaped dicts, with errors that name the key.

``build(cls, data)`` walks the dataclass's type hints: nested dataclasses, enums, ``X | None``,
``list[...]``/``tuple[...]`` of scalars, and scalars (an int is accepted for a float, a bool
is never accepted for an int). Unknown keys are errors. ``apply_overrides`` implements
``--set dotted.key=value`` (the value parsed as YAML, so ``--set engine.block_size=32`` is an
int and ``--set model=null`` is None). ``to_dict`` gives back plain YAML-able data.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from enum import Enum
from typing import Any, TypeVar

import yaml

from common.config_base import ConfigError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(key, "must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(key, f"{value!r} is not a valid {_union_name(args)}{_yaml_hint(value)}")
    if value is None:
        raise ConfigError(key, "must not be null")
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin in (list, tuple):
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise ConfigError(key, f"must be a list, got {value!r}")
        (item_type, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping, got {value!r}")
        _, value_type = typing.get_args(tp)
        return {str(k): _convert(v, value_type, f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in tp)
            raise ConfigError(key, f"{value!r} is not one of: {choices}") from None
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"must be a number, got {value!r}{_yaml_hint(value)}")
        if not math.isfinite(value):  # NaN passes every "< 0" check and fails later
            raise ConfigError(key, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            # YAML reads 1:30 as 90, on as true, 010 as 8: say how to keep the text.
            raise ConfigError(
                key, f"must be a string, got {value!r} (quote it in YAML, or --set {key}='\"...\"')"
            )
        return value
    raise ConfigError(key, f"unsupported type {_type_name(tp)}")


def _union_name(args: tuple) -> str:
    return " or ".join(_type_name(a) for a in args if a is not type(None))


# Keys that were renamed: a clear error naming the new one, not just "unknown key".
_RENAMED = {
    "router.max_inflight_requests": "router.max_inflight_sequences (it counts sequences: "
    "a request runs len(prompts) * n)",
}


def build(cls: type[T], data: Any, prefix: str = "") -> T:
    """An instance of dataclass ``cls`` from a mapping; missing keys take their defaults."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix or "config", f"must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else str(unknown[0])
        if key in _RENAMED:
            raise ConfigError(key, f"renamed to {_RENAMED[key]} (see DESIGN_NOTES.md)")
        raise ConfigError(key, _unknown(str(unknown[0]), fields, "key"))
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if prefix and not exc.key.startswith(prefix):
            key = f"{prefix}.{exc.key.split('.')[-1]}"
            raise ConfigError(key, str(exc).split(": ", 1)[1]) from None
        raise


def _unknown(name: str, known: typing.Iterable[str], what: str) -> str:
    """An unknown key's message: the known keys it is closest to (a typo's fix), else
    all of them."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if close:
        return f"unknown {what}; did you mean {' or '.join(close)}?"
    return f"unknown {what} (known: {', '.join(known)})"


# The keys that name paths on this machine (and a LoRA adapter's, each value of
# ``lora.adapters``), where "~" is the user's home, as a shell reads it: taken literally,
# a model under ~/... was "no checkpoint directory" and ``shared_dir: ~/kv`` made a
# directory named "~" in the working directory (an audit).
_PATH_KEYS = (("model",), ("engine", "draft_model"), ("prefill", "engine", "draft_model"),
              ("decode", "engine", "draft_model"), ("planner", "profile"),
              ("kv_transfer", "shared_dir"))  # fmt: skip


def with_home_expanded(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a leading ``~`` of each path value expanded (``_PATH_KEYS``)."""

    def expanded(value: Any) -> Any:
        return os.path.expanduser(value) if isinstance(value, str) else value

    def at(section: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
        head, *rest = keys
        if head not in section:
            return section
        if not rest:
            return {**section, head: expanded(section[head])}
        inner = section[head]
        return {**section, head: at(inner, tuple(rest))} if isinstance(inner, dict) else section

    for keys in _PATH_KEYS:
        data = at(data, keys)
    lora = data.get("lora")
    if isinstance(lora, dict) and isinstance(lora.get("adapters"), dict):
        adapters = {name: expanded(path) for name, path in lora["adapters"].items()}
        data = {**data, "lora": {**lora, "adapters": adapters}}
    return data


def typed_role_engines(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each role's ``engine`` overrides converted like ``engine`` itself.

    The role sections hold their engine differences as a free mapping; without this a
    ``decode.engine.max_num_seqs: lots`` would reach the engine as a string. Unknown or
    mistyped settings are named as ``decode.engine.<key>``.
    """
    from common.engine_config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    result = dict(data)
    for role in ("prefill", "decode"):
        section = result.get(role)
        if not isinstance(section, dict) or not isinstance(section.get("engine"), dict):
            continue
        converted = {}
        for name, value in section["engine"].items():
            key = f"{role}.engine.{name}"
            if name not in hints:
                raise ConfigError(key, _unknown(str(name), hints, "engine setting"))
            converted[name] = _convert(value, hints[name], key)
        result[role] = {**section, "engine": converted}
    return result


# Mappings whose keys are names a user picks, which may hold dots (an adapter "my.v1"):
# an override's keys past one of these are one name.
_NAMED_MAPPINGS = (("lora", "adapters"),)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["engine.block_size=32", ...]`` applied to a nested dict (a new one is returned)."""
    result = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like dotted.key=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        for mapping in _NAMED_MAPPINGS:
            if tuple(keys[: len(mapping)]) == mapping and len(keys) > len(mapping) + 1:
                keys = [*mapping, ".".join(keys[len(mapping) :])]
        if not all(keys):
            raise ConfigError(dotted, "empty key in override")
        node = result
        for key in keys[:-1]:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(dotted, f"{key} is not a section")
            node = child
        try:
            node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or "not valid YAML"
            raise ConfigError(dotted, f"the value {raw!r} is not valid YAML ({problem}); "
                              "quote it to give a string") from None  # fmt: skip
    return result


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the
    last silently (a second ``engine:`` section dropped the first's settings)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # ``<<: *anchor``: construct_mapping merges it (a key given beside wins)
        key = loader.construct_object(key_node, deep=True)
        try:
            repeated = key in seen
        except TypeError:
            continue  # an unhashable key: construct_mapping refuses it as a YAMLError
        if repeated:
            line = key_node.start_mark.line + 1
            raise ConfigError("config", f"line {line}: {key!r} is given twice in one mapping")
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(path: str) -> Any:
    """A config file's data; ``ConfigError`` naming the file for what cannot be read,
    is not UTF-8 or not YAML, or repeats a key."""
    from pathlib import Path

    try:
        text = Path(path).read_bytes().decode()
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("config", f"{path} is not UTF-8 text (byte {exc.start})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from None
    except ConfigError as exc:
        raise ConfigError("config", f"{path}: {str(exc).split(': ', 1)[1]}") from None


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def to_dict(config: Any) -> Any:
    """Plain data (dicts, lists, scalars) of a config, enums as their values."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, list | tuple):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, Enum):
        return config.value
    return config


def load_config(path: str | None = None, overrides: list[str] | None = None):
    """The deployment config from a YAML file (or defaults) plus ``--set`` overrides,
    validated as a whole: types, values, ports and, when the model's config.json is on this
    machine, whether each role's KV cache fits (``common.kv_budget``). Every entry point
    loads through here, so a bad config stops them all before anything starts."""

    from common.config import PdserveConfig
    from common.kv_budget import check_kv_fit

    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of sections, got {data!r}")
    data = with_home_expanded(typed_role_engines(apply_overrides(data, overrides or [])))
    config = build(PdserveConfig, data)
    check_kv_fit(config)
    return config


_YAML_TEXT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _yaml_hint(value: Any) -> str:
    """Why a number came as text: YAML 1.1 (PyYAML) reads 6e2 and 1.2e3 as strings."""
    if not isinstance(value, str) or not _YAML_TEXT_FLOAT.fullmatch(value.strip()):
        return ""
    mantissa, _, exponent = value.strip().lower().partition("e")
    mantissa += "" if "." in mantissa else ".0"
    mantissa = re.sub(r"^([-+]?)\.", r"\g<1>0.", mantissa)  # (PyYAML: a digit before the '.')
    exponent = exponent if exponent[0] in "+-" else "+" + exponent
    return (f" (YAML reads an exponent without a '.' and a sign as text: write "
            f"{mantissa}e{exponent})")  # fmt: skip
