"""Loading msgspec config Structs from TOML files and keyword overrides, with one-line errors."""

from __future__ import annotations

import fnmatch
import importlib
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
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


CACHE_FILTER_KEYS = ("caches", "exclude_caches")
"""Keys of every consumer table (and of kafka-to-node) that choose caches by name."""


class BadCacheFilter(ValueError):
    """A ``caches``/``exclude_caches`` value that is not a list of names or glob patterns."""

    def __init__(self, key: str, what: str) -> None:
        super().__init__(f"key '{key}': {what}")
        self.key = key
        self.what = what


def _unclosed_bracket(pattern: str) -> bool:
    """Whether a ``[`` of ``pattern`` has no closing ``]`` (fnmatch would match it literally,
    silently; a cache name with a ``[`` is rarer than a typo)."""
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1  # a ']' first in a set is a member, as in fnmatch
            end = pattern.find("]", j)
            if end < 0:
                return True
            i = end
        i += 1
    return False


def _old_regex_hint(spec: str) -> str:
    """What to write instead of the old one-regex form: the list it means when that is plain."""
    parts = [p.replace(".*", "*") for p in spec.split("|")]
    if all(p and re.fullmatch(r"[\w*-]+", p) for p in parts):
        return "[" + ", ".join(f'"{p}"' for p in parts) + "]"
    return '["orders", "people_*"]'


class CacheFilter:
    """Which caches a consumer gets, by name: a cache is delivered when ``caches`` is empty or one
    of its patterns matches the name, and no pattern of ``exclude_caches`` does (exclusion wins).

    A pattern is a cache name or an fnmatch-style glob matched against the whole name, case-
    sensitively: ``*`` any run of characters (also none), ``?`` one character, ``[abc]`` one of
    them, ``[!abc]`` one not of them. Refused: a pattern that is empty or has a ``[`` without a
    closing ``]``, and a single string (the old form, one regular expression)."""

    def __init__(self, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> None:
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self._include = [re.compile(fnmatch.translate(p)) for p in self.include]
        self._exclude = [re.compile(fnmatch.translate(p)) for p in self.exclude]
        self._known: dict[str, bool] = {}

    @property
    def everything(self) -> bool:
        return not self.include and not self.exclude

    def __call__(self, name: str) -> bool:
        ok = self._known.get(name)
        if ok is None:
            ok = (not self._include or any(p.match(name) for p in self._include)) and not any(
                p.match(name) for p in self._exclude
            )
            if len(self._known) < 100_000:  # bounded: names are few, but a table need not trust that
                self._known[name] = ok
        return ok

    @classmethod
    def parse(cls, table: Mapping[str, Any]) -> CacheFilter:
        """The filter of a table's ``caches`` and ``exclude_caches`` keys (absent: everything);
        BadCacheFilter names the key."""
        lists = []
        for key in CACHE_FILTER_KEYS:
            value = table.get(key, [])
            if isinstance(value, str):
                raise BadCacheFilter(
                    key,
                    f"one regular expression ({value!r}) is the old form, no longer read; write a list of "
                    f"names or glob patterns, e.g. {key} = {_old_regex_hint(value)}"
                    + ("" if key == "exclude_caches" else ", and exclude_caches = [...] for names to leave out"),
                )
            if not isinstance(value, list):
                raise BadCacheFilter(key, f"expected a list of names or glob patterns, got {type(value).__name__}")
            for pattern in value:
                if not isinstance(pattern, str):
                    raise BadCacheFilter(key, f"expected names or glob patterns (strings), got {pattern!r}")
                if not pattern:
                    raise BadCacheFilter(key, "an empty pattern matches no cache")
                if _unclosed_bracket(pattern):
                    raise BadCacheFilter(key, f"bad pattern {pattern!r}: '[' without a closing ']'")
            lists.append(value)
        return cls(*lists)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], source: str) -> CacheFilter:
        """``parse``, its errors a ConfigError naming ``source`` and the key."""
        try:
            return cls.parse(table)
        except BadCacheFilter as exc:
            raise ConfigError(f"{source}: {exc}") from None


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
