"""Build attrs records (the core config, each backend's options) from plain TOML data.

Every failure is a :class:`~ssu.contract.errors.ConfigError` naming the option's full path (for example
``ssu.backends.triton.num_warps``), what was expected and, for unknown keys, the closest valid one.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Iterable, Literal, Union

import attrs

from .errors import ConfigError


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or an empty string."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def prefixed(prefix: str, message: str) -> str:
    """``message`` with ``prefix`` (e.g. the file) before each of its lines: a table's several
    problems are one line each (:func:`build`), and each line must say where it is."""
    return "\n".join(f"{prefix}{line}" for line in message.splitlines())


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        plural = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(args[0], _describe(args[0]))}" if args else "a list"
    if tp is type(None):
        return "nothing (omit the key)"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a table"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def matches(value: Any, tp: Any) -> bool:
    """Whether a TOML value fits a (simple) type annotation."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return any(value == v and type(value) is type(v) for v in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and (not args or all(matches(v, args[0]) for v in value))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def build(cls: type, data: dict, path: str) -> Any:
    """Instantiate attrs class ``cls`` from ``data``, refusing unknown keys and wrong types (all of
    them at once, one line each).

    >>> import attrs
    >>> @attrs.frozen
    ... class Opts:
    ...     num_warps: int = 4
    >>> build(Opts, {"num_warps": 8}, "ssu.backends.x")
    Opts(num_warps=8)
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table, got {type(data).__name__} {data!r}")
    attrs.resolve_types(cls)
    fields = {f.alias or f.name: f for f in attrs.fields(cls) if f.init and not f.metadata.get("internal")}
    problems = []
    for key in data:
        if key not in fields:
            problems.append(
                f"{path}.{key}: unknown option{did_you_mean(key, fields)}; valid options: {', '.join(fields) or 'none'}"
            )
    for key, value in data.items():
        field = fields.get(key)
        if field is not None and field.type is not None and not matches(value, field.type):
            problems.append(f"{path}.{key}: expected {_describe(field.type)}, got {value!r}")
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return cls(**data)
    except ConfigError as exc:
        message = str(exc)
        field = message.split("=", 1)[0]
        if field in fields:  # a validator's "name=value ..." becomes "path.name=value ..."
            raise ConfigError(f"{path}.{message}") from None
        raise ConfigError(f"{path}: {message}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def choice(*valid: Any):
    """An attrs validator refusing values outside ``valid`` with the list of valid ones."""

    def check(instance, attribute, value) -> None:
        if value not in valid:
            raise ConfigError(
                f"{attribute.name}={value!r} is not valid; use one of {', '.join(repr(v) for v in valid)}"
            )

    return check


def in_range(low: int, high: int):
    """An attrs validator for integers in ``[low, high]``."""

    def check(instance, attribute, value) -> None:
        if not (low <= value <= high):
            raise ConfigError(f"{attribute.name}={value!r} is out of range; use {low} to {high}")

    return check
