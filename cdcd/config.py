"""Loading msgspec config Structs from TOML files and keyword overrides, with one-line errors."""

from __future__ import annotations

import fnmatch
import importlib
import math
import os
import re
import threading
import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog

from cdcd.faults import ExitCode, Fault

T = TypeVar("T")


class ConfigError(Fault, ValueError):
    """Bad configuration: the message names the file (or source) and the key.

    An unknown key's error also carries ``unknown_key`` (its path in the table) and ``known_keys``
    (the keys its table takes), so a caller that knows more keys of the same table (a consumer
    table's common keys) can name a closer one (``with_known_keys``)."""

    exit_code = ExitCode.BAD_INPUT

    def __init__(self, message: str, *, unknown_key: str = "", known_keys: Collection[str] = ()) -> None:
        super().__init__(message)
        self.unknown_key = unknown_key
        self.known_keys = tuple(known_keys)


def edit_distance(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) that turn ``a`` into ``b``."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            d = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                d = min(d, prev2[j - 2] + 1)
            cur.append(d)
        prev2, prev = prev, cur
    return prev[-1]


def close_key(key: str, known: Iterable[str]) -> str | None:
    """The known key within two edits of ``key`` (the closest, then the first by name), if any; not
    for a key so short that two edits would make it anything."""
    best: tuple[int, str] | None = None
    for candidate in known:
        if candidate == key:
            continue
        d = edit_distance(key, candidate)
        if d <= 2 and d <= len(key) // 2 and (best is None or (d, candidate) < best):
            best = (d, candidate)
    return best[1] if best else None


def unknown_key_error(source: str, key: str, known: Collection[str]) -> ConfigError:
    """``source: unknown key 'key'``, with "(did you mean 'k'?)" when a known key is close."""
    leaf = key.rpartition(".")[2]
    near = close_key(leaf, known)
    hint = f" (did you mean '{near}'?)" if near else ""
    return ConfigError(f"{source}: unknown key '{key}'{hint}", unknown_key=key, known_keys=known)


def with_known_keys(exc: ConfigError, source: str, more: Collection[str]) -> ConfigError:
    """``exc`` again, its hint chosen among its table's keys and ``more`` (keys the same table takes
    that were read before the rest went to ``convert``), when it is an unknown top-level key."""
    if not exc.unknown_key or "." in exc.unknown_key:
        return exc
    return unknown_key_error(source, exc.unknown_key, (*exc.known_keys, *more))


_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")


def _step(info: msgspec.inspect.Type, part: str) -> msgspec.inspect.Type | None:
    """The type one step down a msgspec error path (a field name, or ``[...]``/``[N]`` for an item)."""
    for t in info.types if isinstance(info, msgspec.inspect.UnionType) else (info,):
        if part.startswith("["):
            if isinstance(t, msgspec.inspect.DictType):
                return t.value_type
            if isinstance(t, msgspec.inspect.ListType | msgspec.inspect.SetType | msgspec.inspect.VarTupleType):
                return t.item_type
        elif isinstance(t, msgspec.inspect.StructType):
            for field in t.fields:
                if field.encode_name == part:
                    return field.type
    return None


def _keys_at(cls: type, where: str) -> list[str]:
    """The keys the table at ``where`` (a msgspec error path below ``cls``) takes; [] if unknown."""
    info: msgspec.inspect.Type | None = msgspec.inspect.type_info(cls)
    for part in re.findall(r"[^.\[]+|\[[^\]]*\]", where):
        if info is None:
            return []
        info = _step(info, part)
    for t in info.types if isinstance(info, msgspec.inspect.UnionType) else (info,):
        if isinstance(t, msgspec.inspect.StructType):
            return [f.encode_name for f in t.fields]
    return []


def _error(exc: msgspec.ValidationError, cls: type, source: str) -> ConfigError:
    msg = str(exc)
    m = _PATH_RE.search(msg)
    where = m.group(1) if m else ""
    msg = _PATH_RE.sub("", msg)
    unknown = re.match(r"Object contains unknown field `([^`]*)`", msg)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return unknown_key_error(source, key, _keys_at(cls, where))
    return ConfigError(f"{source}: key '{where}': {msg}" if where else f"{source}: {msg}")


def convert(data: Mapping[str, Any], cls: type[T], source: str) -> T:
    """Build ``cls`` from a plain mapping; errors become ``ConfigError`` naming source and key (an
    unknown key with the key of its table it is a typo of, if any: ``unknown_key_error``).

    Deprecated spellings in the tables a class names in its ``consumer_tables`` class variable are
    read as their new spelling first (``upgrade_table``). A number that is not finite (TOML's
    ``nan``, ``inf``, or a string that converts to one) is refused for every key: no setting of
    cdcd means anything at NaN or infinity."""
    tables: Iterable[str] = getattr(cls, "consumer_tables", ())
    if tables:
        data = dict(data)
        for key in tables:
            if isinstance(data.get(key), Mapping):
                data[key] = upgrade_table(data[key], "consumer", f"{source}: {key}")
    try:
        result = msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise _error(exc, cls, source) from None
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


# --- Deprecated spellings ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deprecated:
    """A spelling a release renamed: from ``deprecated_in`` it is read as the new one with a warning
    (``cdcd --strict-config``: refused), and from ``removed_in``, one minor release later, refused."""

    scope: str
    """Which tables: ``consumer`` (every consumer table: a daemon's ``[consumer]``, a node's
    ``[realtime_consumer]``) or ``kafka-to-node`` (that command's file)."""
    old: str
    new: str
    """The spellings, as docs/operations.md and CHANGELOG.md name them."""
    deprecated_in: str
    removed_in: str
    rewrite: Callable[[dict[str, Any], str], str | None]
    """Rewrites a table that holds the old spelling in place and says what changed; None when the
    table does not hold it. May raise ConfigError (both spellings set)."""


def _renamed_key(old: str, new: str) -> Callable[[dict[str, Any], str], str | None]:
    def rewrite(table: dict[str, Any], source: str) -> str | None:
        if old not in table:
            return None
        if new in table:
            raise ConfigError(f"{source}: key '{old}' is the old spelling of '{new}', which is set too: keep '{new}'")
        table[new] = table.pop(old)
        return f"key '{old}' is now '{new}'"

    return rewrite


def _renamed_value(
    key: str, old: str, new: str, *, kind: str | None = None
) -> Callable[[dict[str, Any], str], str | None]:
    def rewrite(table: dict[str, Any], _source: str) -> str | None:
        if table.get(key) != old or (kind is not None and table.get("kind") != kind):
            return None
        table[key] = new
        return f'key \'{key}\': "{old}" is now "{new}"'

    return rewrite


_PLAIN_CHAR = re.compile(r"[\w-]")


def regex_as_globs(spec: str) -> list[str] | None:
    """The glob patterns that match exactly the names the old one-regex ``caches`` matched (Python
    ``re.fullmatch``), or None when no list of globs says the same. Exactly, for every cache name
    without a line break: a regex ``.`` never matched one, a glob's ``?`` and ``*`` do.

    Read: alternatives (``|``, the whole optionally in one group), each of letters, digits, ``_``,
    ``-``, ``\\.`` (a dot), ``.`` (one character: ``?``), ``.*`` (``*``) and ``.+`` (``?*``), an
    optional ``^`` in front and ``$`` at the end (redundant under fullmatch). Anything else (classes,
    other repeats, nested groups) has no glob of the same meaning, and is not guessed at."""
    body = spec
    for opening in ("(?:", "("):
        if body.startswith(opening) and body.endswith(")"):
            body = body[len(opening) : -1]
            break
    globs: list[str] = []
    for alternative in body.split("|"):
        text = alternative.removeprefix("^")
        if text.endswith("$") and not text.endswith("\\$"):
            text = text[:-1]
        out: list[str] = []
        i = 0
        while i < len(text):
            c = text[i]
            nxt = text[i + 1] if i + 1 < len(text) else ""
            if c == "\\" and nxt == ".":
                out.append(".")
                i += 2
            elif c == "." and nxt in ("*", "+"):
                out.append("*" if nxt == "*" else "?*")
                i += 2
            elif c == ".":
                out.append("?")
                i += 1
            elif _PLAIN_CHAR.fullmatch(c) and nxt not in ("*", "+", "?", "{"):
                out.append(c)
                i += 1
            else:
                return None
        if not out:
            return None  # an empty alternative matched only the empty name: no cache has it
        globs.append("".join(out))
    return globs


def _caches_regex(table: dict[str, Any], _source: str) -> str | None:
    spec = table.get("caches")
    if not isinstance(spec, str):
        return None
    globs = regex_as_globs(spec)
    if globs is None:
        return None  # left as it is: CacheFilter refuses it, naming a list to write
    table["caches"] = globs
    listed = ", ".join(f'"{g}"' for g in globs)
    return f"key 'caches': one regular expression ({spec!r}) is now a list of names or globs: caches = [{listed}]"


DEPRECATED: tuple[Deprecated, ...] = (
    Deprecated(
        "consumer", 'kind = "spark"', 'kind = "lake"', "0.2.0", "0.3.0", _renamed_value("kind", "spark", "lake")
    ),
    Deprecated(
        "consumer",
        'writer = "arrow"',
        'writer = "deltalake"',
        "0.2.0",
        "0.3.0",
        _renamed_value("writer", "arrow", "deltalake", kind="lake"),
    ),
    Deprecated(
        "consumer", "max_retry_s", "retry_timeout_s", "0.2.0", "0.3.0", _renamed_key("max_retry_s", "retry_timeout_s")
    ),
    Deprecated("consumer", 'caches = "<regex>"', 'caches = ["<name or glob>", ...]', "0.2.0", "0.3.0", _caches_regex),
    Deprecated(
        "kafka-to-node",
        "max_retry_s",
        "retry_timeout_s",
        "0.2.0",
        "0.3.0",
        _renamed_key("max_retry_s", "retry_timeout_s"),
    ),
    Deprecated(
        "kafka-to-node", 'caches = "<regex>"', 'caches = ["<name or glob>", ...]', "0.2.0", "0.3.0", _caches_regex
    ),
)
"""Every spelling read for one more minor release. The spellings of 0.2.0 were renamed before
v0.1.0, which refused them; 0.2.0 reads them again so that a config that worked before v0.1.0
keeps working until 0.3.0. An entry is deleted in the release named ``removed_in`` (a test fails
on one whose release has come)."""


class _Notices:
    """What the process does with a deprecated spelling it reads (one policy per process: the
    command line sets it once, from ``--strict-config``)."""

    def __init__(self) -> None:
        self.strict = False
        self.echo: Callable[[str], None] | None = None
        self.log_ready = True
        self.pending: list[tuple[Deprecated, str, str]] = []
        """(deprecation, source, what it said) held until logging is set up."""
        self.seen: dict[str, None] = {}
        self.lock = threading.Lock()


_NOTICES = _Notices()
_log = structlog.get_logger("cdcd.config")


def set_deprecation_policy(*, strict: bool, echo: Callable[[str], None] | None = None, log_later: bool = False) -> None:
    """``strict``: a deprecated spelling is a ConfigError (exit 2). Otherwise each is logged once,
    as a ``config_deprecated`` warning, and also handed to ``echo`` (the command line's stderr line).
    ``log_later``: hold the log lines until ``deprecations_loggable`` (logging is not set up yet).
    Each call starts afresh (a command run in-process, as the tests do, is told its own warnings)."""
    with _NOTICES.lock:
        _NOTICES.strict = strict
        _NOTICES.echo = echo
        _NOTICES.log_ready = not log_later
        _NOTICES.pending = []
        _NOTICES.seen = {}


def deprecations_loggable() -> None:
    """Logging is set up: log the deprecation warnings held so far, and later ones at once."""
    with _NOTICES.lock:
        pending, _NOTICES.pending = _NOTICES.pending, []
        _NOTICES.log_ready = True
    for deprecated, source, said in pending:
        _log_notice(deprecated, source, said)


def _log_notice(deprecated: Deprecated, source: str, said: str) -> None:
    _log.warning(
        "config_deprecated",
        source=source,
        old=deprecated.old,
        new=deprecated.new,
        removed_in=deprecated.removed_in,
        detail=said,
    )


def _notice(deprecated: Deprecated, source: str, said: str) -> None:
    when = f"deprecated in {deprecated.deprecated_in}, refused from {deprecated.removed_in}"
    if _NOTICES.strict:
        raise ConfigError(f"{source}: {said} (the old spelling is {when}; --strict-config refuses it)")
    line = f"{source}: {said} ({when})"
    with _NOTICES.lock:
        if line in _NOTICES.seen:
            return
        _NOTICES.seen[line] = None
        echo, log_now = _NOTICES.echo, _NOTICES.log_ready
        if not log_now:
            _NOTICES.pending.append((deprecated, source, said))
    if echo is not None:
        echo(line)
    if log_now:
        _log_notice(deprecated, source, said)


def upgrade_table(table: Mapping[str, Any], scope: str, source: str) -> dict[str, Any]:
    """``table`` with every deprecated spelling of ``scope`` rewritten as its new one, each told
    once (``set_deprecation_policy``); the table itself is not changed."""
    out = dict(table)
    for deprecated in DEPRECATED:
        if deprecated.scope == scope:
            said = deprecated.rewrite(out, source)
            if said is not None:
                _notice(deprecated, source, said)
    return out
