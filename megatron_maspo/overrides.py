"""``--set a.b=value`` overrides and dict <-> dataclass conversion for the config tree.

Values are coerced against the dataclass field's annotation (bool, int, float, str, ``X | None``,
``Literal``, lists of scalars). An unknown key or a value that does not fit fails with a ``ConfigError``
naming the key and what it accepts. After all overrides the tree is rebuilt once, so every
``__post_init__`` validation runs on the final values (the order of ``--set`` does not matter).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from megatron_maspo.errors import ConfigError

_NONE_WORDS = {"none", "null", "~"}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, text: Any, tp: Any) -> Any:
    """Convert ``text`` (a string from the command line, or a YAML scalar) to annotation ``tp``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        says_none = text is None or (isinstance(text, str) and text.strip().lower() in _NONE_WORDS)
        if says_none and type(None) in get_args(tp):
            return None
        errors = []
        for a in args:
            try:
                return _coerce(key, text, a)
            except ValueError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: cannot read {text!r} as {tp}: {'; '.join(errors)}")
    if origin is Literal:
        choices = get_args(tp)
        for c in choices:
            if str(c) == str(text):
                return c
        raise ConfigError(f"{key}: {text!r} is not one of {list(choices)}")
    if origin in (list, tuple):
        (inner,) = get_args(tp)[:1] or (str,)
        items = text if isinstance(text, list | tuple) else [t for t in str(text).split(",") if t.strip()]
        vals = [_coerce(key, t.strip() if isinstance(t, str) else t, inner) for t in items]
        return vals if origin is list else tuple(vals)
    if origin is dict or tp is dict:
        if isinstance(text, dict):
            return text
        raise ConfigError(f"{key}: dict fields cannot be set from the command line")
    if tp is bool:
        if isinstance(text, bool):
            return text
        s = str(text).strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        raise ConfigError(f"{key}: {text!r} is not a boolean; accepted: true/false")
    if tp is int:
        if isinstance(text, bool):
            raise ConfigError(f"{key}: {text!r} is not an integer")
        try:
            return int(str(text).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}: {text!r} is not an integer") from None
    if tp is float:
        try:
            number = float(text)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: {text!r} is not a number") from None
        if not math.isfinite(number):  # inf / nan would start a run that fails (or is silently wrong) later
            raise ConfigError(f"{key}: {text!r} is not a finite number")
        return number
    if tp is str:
        return str(text)
    if tp is Any:
        return text
    raise ConfigError(f"{key}: fields of type {tp} cannot be overridden")


def apply_overrides(cfg: Any, assignments: list[str]) -> Any:
    """Return a copy of the dataclass tree ``cfg`` with ``key=value`` assignments applied.

    Each key and value is checked as it comes (unknown key, wrong type: the message names it), but the
    sections' validation runs once, on the result: ``--set parallel.tp=2 --set parallel.world_size=2``
    works in either order.

    Raises:
        ConfigError: malformed assignment, unknown key (lists the accepted keys at that level), a value of
            the wrong type, or a result the components' validation rejects (naming the assignments).
    """
    if not assignments:
        return cfg
    data = to_dict(cfg)
    for a in assignments:
        if "=" not in a:
            raise ConfigError(f"override {a!r} must look like section.field=value")
        key, value = a.split("=", 1)
        _set_in(type(cfg), data, key.strip().split("."), value, key.strip())
    return _rebuild(type(cfg), data, ", ".join(assignments))


def set_path(cfg: Any, key: str, value: Any) -> Any:
    """Return a copy of ``cfg`` with the dotted ``key`` set to ``value`` (coerced and validated)."""
    data = to_dict(cfg)
    _set_in(type(cfg), data, key.split("."), value, key)
    return _rebuild(type(cfg), data, f"{key}={value!r}")


def _rebuild(cls: type, data: dict, what: str) -> Any:
    """``cls`` from ``data``, every section validated once; a rejection names ``what`` was set."""
    try:
        return from_dict(cls, data)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{what} rejected: {e}") from None


def _set_in(cls: type, data: dict, parts: list[str], value: Any, full_key: str) -> None:
    """Set ``parts`` in the plain-dict form ``data`` of dataclass ``cls``, coercing ``value``."""
    name = parts[0]
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    if name not in names:
        where = full_key[: full_key.index(name)] if name in full_key else ""
        raise ConfigError(f"unknown config key {full_key!r}: {where or 'top level'} accepts {names}")
    tp = _hints(cls)[name]
    if len(parts) == 1:
        if dataclasses.is_dataclass(tp):
            raise ConfigError(f"{full_key} is a section; set one of its fields: "
                              f"{[f.name for f in dataclasses.fields(tp) if f.init]}")
        data[name] = _coerce(full_key, value, tp)
        return
    if not dataclasses.is_dataclass(tp):
        raise ConfigError(f"{full_key}: cannot descend into a non-config value")
    _set_in(tp, data.setdefault(name, {}), parts[1:], value, full_key)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a dataclass tree (for YAML: tuples become lists)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, validating keys and types like ``--set`` does."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = set(data) - set(names)
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(prefix + k for k in unknown)}; "
                         f"{prefix.rstrip('.') or 'top level'} accepts {names}")
    kwargs = {}
    for k, v in data.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = from_dict(tp, v or {}, prefix + k + ".")
        else:
            kwargs[k] = _coerce(prefix + k, v, tp)
    return cls(**kwargs)
