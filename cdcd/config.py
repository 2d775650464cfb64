"""Loading msgspec config Structs from TOML files and keyword overrides, with one-line errors."""

from __future__ import annotations

import importlib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from cdcd.faults import ExitCode, Fault

T = TypeVar("T")


class ConfigError(Fault, ValueError):
    """Bad configuration: the message names the file (or source) and the key."""

    exit_code = ExitCode.BAD_INPUT


_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")


def _describe(exc: msgspec.ValidationError) -> str:
    msg = str(exc)
    m = _PATH_RE.search(msg)
    where = m.group(1) if m else ""
    msg = _PATH_RE.sub("", msg)
    unknown = re.match(r"Object contains unknown field `([^`]*)`", msg)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return f"unknown key '{key}'"
    return f"key '{where}': {msg}" if where else msg


def convert(data: Mapping[str, Any], cls: type[T], source: str) -> T:
    """Build ``cls`` from a plain mapping; errors become ``ConfigError`` naming source and key.

    A number that is not finite (TOML's ``nan``, ``inf``, or a string that converts to one) is
    refused for every key: no setting of cdcd means anything at NaN or infinity."""
    try:
        result = msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_describe(exc)}") from None
    bad = _non_finite(msgspec.to_builtins(result), "")
    if bad is not None:
        key, value = bad
        raise ConfigError(f"{source}: key '{key}': {value} is not a finite number")
    return result


def _non_finite(value: Any, key: str) -> tuple[str, float] | None:
    """The first (key path, value) of a NaN or infinite float in a config's builtins."""
    if isinstance(value, float) and not math.isfinite(value):
        return key, value
    if isinstance(value, dict):
        for k, v in value.items():
            found = _non_finite(v, f"{key}.{k}" if key else str(k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _non_finite(v, f"{key}[{i}]")
            if found is not None:
                return found
    return None


def import_object(spec: str, source: str, key: str) -> Any:
    """The object ``package.module:Name`` names (a user's class in a config); errors name the key."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{source}: key '{key}': expected 'package.module:ClassName', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{source}: key '{key}': cannot import {module_name!r}: {exc}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{source}: key '{key}': {module_name!r} has no attribute {attr!r}")
    return obj


def cache_filter(spec: list[str] | str, source: str) -> Callable[[str], bool]:
    """A ``caches`` key (names, or one regular expression matching whole names; ``[]``: all) as a
    predicate on cache names."""
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as exc:
            raise ConfigError(f"{source}: key 'caches': bad regular expression {spec!r}: {exc}") from None
        return lambda name: pattern.fullmatch(name) is not None
    if not spec:
        return lambda name: True
    return frozenset(spec).__contains__


def check_ranges(config: object, checks: Mapping[str, bool]) -> None:
    """In a config Struct's ``__post_init__``: the first key whose check is False is a
    ValidationError naming it and its value (``convert`` makes that a one-line ConfigError)."""
    for key, ok in checks.items():
        if not ok:
            raise msgspec.ValidationError(f"out of range: {getattr(config, key)} - at `$.{key}`")


def split_host_port(address: str, *, min_port: int = 1) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (``min_port = 0``: any free port, for listening)."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not min_port <= int(port) < 65536:
        raise ValueError(f"expected host:port, got {address!r}")
    return host, int(port)


def check_address(address: str, key: str, *, min_port: int = 0) -> None:
    """Like ``check_ranges`` for a ``host:port`` setting ("" is allowed: off)."""
    if address:
        try:
            split_host_port(address, min_port=min_port)
        except ValueError as exc:
            raise msgspec.ValidationError(f"{exc} - at `$.{key}`") from None


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a TOML file (invalid UTF-8 at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None


def load_toml(path: str | os.PathLike[str], cls: type[T], overrides: Mapping[str, Any] | None = None) -> T:
    data = read_toml(path)
    if overrides:
        data.update(overrides)
    return convert(data, cls, str(path))
