"""Daemon configuration (``config/cdcd.toml``), with ``CDCD_*`` environment overrides."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec

from cdcd.config import (
    CacheFilter,
    ConfigError,
    check_address,
    check_ranges,
    close_key,
    convert,
    load_toml,
    read_toml,
)
from cdcd.node.config import NodeConfig

MiB = 1 << 20
ENV_PREFIX = "CDCD_"
DEFAULT_CONSUMER = "default"
"""The name of the consumer a ``[consumer]`` table describes (its state is the ``state_dir`` itself)."""
CONSUMER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CATCHUP_MAX_SHARE = 0.5
"""Default ``catchup_max_share``: a consumer catching up works at most half the time while another is live."""


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    consumer_tables: ClassVar[tuple[str, ...]] = ("consumer",)
    """Read with their deprecated spellings upgraded (``cdcd.config.upgrade_table``)."""

    node_dir: str
    """The node whose CDC directory is followed."""
    node_config: str = ""
    """That node's own config file (``config/node.toml``), as ignite-cdc reads its node's: where the node's
    control socket and metastorage are when its ``control_socket`` or ``db_dir`` is not the default.
    Default: the node's defaults under ``node_dir``."""
    cdc_dir: str = ""
    """Default: the node's ``cdc/``."""
    state_dir: str = ""
    """LMDB with position, mode and cache registry (default ``<node_dir>/cdcd-state``)."""
    lock_timeout_ms: int = 10_000
    """A second daemon waits this long for the lock, then exits 1 naming the holder's pid."""
    check_interval_ms: int = 1000
    """Rescan the CDC dir this often, on top of file-system events."""
    batch_max_events: int = 50_000
    batch_max_bytes: int = 16 * MiB
    batch_max_delay_ms: int = 100
    """A batch closes when any of these is reached (live traffic: the delay; backlog: the size)."""
    queue_max_batches: int = 2
    """Bound of each pipeline queue; with the batch bounds this bounds memory."""
    read_chunk_records: int = 1024
    """Records the reader hands to the decoder at a time."""
    consumer_stall_timeout_ms: int = 300_000
    """A consumer call (or segment read) running this long with work pending is a stall: the daemon stops
    its watchdog pings and exits 6 naming it."""
    metrics_address: str = "127.0.0.1:9469"
    """host:port of the Prometheus endpoint ("" disables it)."""
    log_format: Literal["json", "console"] | None = None
    """Default: console on a terminal, JSON lines otherwise (``cdcd run --log-format`` overrides)."""
    consumer: dict[str, Any] = msgspec.field(default_factory=lambda: {"kind": "null"})
    consumers: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    """Named consumers, ``[consumers.<name>]`` (each takes every key ``[consumer]`` takes); with
    ``[consumer]`` beside them, that one is the consumer named ``default``."""
    realtime_consumer: str = ""
    """The consumer the node's realtime worker stands in for: the one whose position follows the
    hand-over markers (IEP-104). Default: ``default`` if there is one, else the first named consumer."""
    shared_read_bytes: int = 64 * MiB
    """Decoded WAL chunks kept for the other consumers of a daemon with several (each reads on its
    own from its position when what it needs is no longer there)."""
    catchup_max_share: float = CATCHUP_MAX_SHARE
    """The default of every consumer's ``catchup_max_share`` (its table's own key wins)."""
    has_default_consumer: bool = True
    """Whether a ``[consumer]`` table was given (or no ``[consumers]`` at all): set by ``load_daemon_config``."""

    def __post_init__(self) -> None:
        if not self.node_dir:
            raise msgspec.ValidationError("must not be empty - at `$.node_dir`")
        for name in self.consumers:
            if not CONSUMER_NAME.fullmatch(name):
                raise msgspec.ValidationError(
                    f"consumer name {name!r}: must be 1 to 64 of A-Z a-z 0-9 _ - - at `$.consumers`"
                )
            if name == DEFAULT_CONSUMER and self.has_default_consumer:
                raise msgspec.ValidationError(
                    "the consumer named default is [consumer]: give this one another name - at `$.consumers.default`"
                )
        if self.realtime_consumer and self.realtime_consumer not in self.named_consumers():
            raise msgspec.ValidationError(
                f"no consumer named {self.realtime_consumer!r} (consumers: {', '.join(self.named_consumers())})"
                " - at `$.realtime_consumer`"
            )
        checks = {
            "lock_timeout_ms": self.lock_timeout_ms >= 0,
            "check_interval_ms": self.check_interval_ms >= 10,
            "batch_max_events": self.batch_max_events >= 1,
            "batch_max_bytes": self.batch_max_bytes >= 1024,
            "batch_max_delay_ms": self.batch_max_delay_ms >= 0,
            "queue_max_batches": self.queue_max_batches >= 1,
            "read_chunk_records": self.read_chunk_records >= 1,
            "consumer_stall_timeout_ms": self.consumer_stall_timeout_ms >= 1000,
            "shared_read_bytes": self.shared_read_bytes >= 0,
            "catchup_max_share": 0.0 < self.catchup_max_share <= 1.0,
        }
        check_ranges(self, checks)
        check_address(self.metrics_address, "metrics_address")

    def node(self) -> NodeConfig:
        """The followed node's config: read from ``node_config``, else the defaults under ``node_dir``."""
        if not self.node_config:
            return NodeConfig(node_dir=self.node_dir)
        try:
            node = load_toml(self.node_config, NodeConfig)
        except ConfigError as exc:
            raise ConfigError(f"key 'node_config': {exc}") from None
        if Path(node.node_dir).resolve() != Path(self.node_dir).resolve():
            raise ConfigError(
                f"key 'node_config': {self.node_config} configures node_dir {node.node_dir}, "
                f"not this daemon's node_dir {self.node_dir}"
            )
        return node

    def named_consumers(self) -> dict[str, dict[str, Any]]:
        """Every consumer's table by name, in config order: ``default`` (``[consumer]``) first."""
        out: dict[str, dict[str, Any]] = {DEFAULT_CONSUMER: self.consumer} if self.has_default_consumer else {}
        out.update(self.consumers)
        return out

    @property
    def handover_consumer(self) -> str:
        """The consumer whose position follows the node's hand-over markers (``realtime_consumer``)."""
        return self.realtime_consumer or next(iter(self.named_consumers()))

    def consumer_key(self, name: str) -> str:
        """Where a consumer's table is in the config: ``consumer`` or ``consumers.<name>``."""
        return "consumer" if name == DEFAULT_CONSUMER and self.has_default_consumer else f"consumers.{name}"

    def consumer_state_path(self, name: str) -> Path:
        """A consumer's own state: ``state_dir`` for ``default`` (as a daemon of one consumer always
        kept it), ``<state_dir>/consumers/<name>`` for a named one."""
        if name == DEFAULT_CONSUMER:
            return self.state_path
        return self.state_path / "consumers" / name

    def for_consumer(self, name: str) -> DaemonConfig:
        """This config as a daemon of consumer ``name`` alone, its state where this daemon keeps that
        consumer's: the operator commands (``state show``, ``state reset``) act on one consumer's state."""
        tables = self.named_consumers()
        if name not in tables:
            raise ConfigError(f"no consumer named {name!r} (consumers: {', '.join(tables)})")
        if name == DEFAULT_CONSUMER and not self.consumers:
            return self
        return msgspec.structs.replace(
            self,
            state_dir=str(self.consumer_state_path(name)),
            consumer=tables[name],
            consumers={},
            realtime_consumer="",
            has_default_consumer=True,
        )

    @property
    def cdc_path(self) -> Path:
        return Path(self.cdc_dir or Path(self.node_dir) / "cdc")

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir or Path(self.node_dir) / "cdcd-state")


IDENTITY_KEYS: dict[str, tuple[str, ...]] = {
    "jsonl": ("path",),
    "lake": ("lake_path",),
    "kafka": ("bootstrap_servers", "topic", "topic_prefix"),
    "replication": ("target",),
    "null": (),
}
"""The keys that say where a consumer of each kind delivers: with the kind, its identity."""
_PATH_KEYS = frozenset({"path", "lake_path"})


def consumer_identity(table: Mapping[str, Any]) -> str:
    """Kind and target of the consumer a ``[consumer]`` table describes (``jsonl /abs/events.jsonl``,
    ``kafka localhost:9092 topic=cdc``): a position is bound to it, so a state written for one target is
    never used for another. Local paths are made absolute (what the sink writes to)."""
    kind = str(table.get("kind", ""))
    kind = "lake" if kind == "spark" else kind  # the deprecated spelling builds the same consumer
    if kind == "python":
        # A class's target is its own business (often a subclass of a shipped sink, or a wrapper around one):
        # its name says nothing about where it delivers, so its state is bound to no identity.
        return ""
    parts = [kind]
    for key in IDENTITY_KEYS.get(kind, ()):
        value = table.get(key)
        if value in (None, ""):
            continue
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        text = str(value)
        if key in _PATH_KEYS and "://" not in text:
            text = os.path.abspath(text)
        parts.append(text if key in _PATH_KEYS or key == "bootstrap_servers" else f"{key}={text}")
    return " ".join(parts)


class LanePolicy(msgspec.Struct, frozen=True):
    """A consumer's keys that only the daemon reads (every kind takes them)."""

    start: Literal["oldest", "now"] = "oldest"
    """Where a consumer without a state starts: at the oldest link, or after the newest segment archived
    now (a consumer added later that needs no history: backfill it with ``cdcd control resend``)."""
    max_retained_bytes: int = 0
    """The most link bytes this consumer may hold back from its position on (0: no cap). Past it the consumer is
    invalidated (PostgreSQL's ``max_slot_wal_keep_size``): it stops, holds no link any more, and stays
    stopped until ``cdcd state reset --consumer NAME``."""
    catchup_max_share: float = CATCHUP_MAX_SHARE
    """While this consumer is behind and another is live (at the head and delivering), the most of the time
    each of its stages (read, decode, delivery) may work: after each step it waits ``(1 - share) / share``
    times what the step took (1.0: no bound). The process's cores and GIL are shared; this keeps them for the
    live ones, at the cost of a catch-up that much slower (``cdcd.daemon.lane.Throttle``)."""


def lane_policy(table: Mapping[str, Any], source: str, default_share: float = CATCHUP_MAX_SHARE) -> LanePolicy:
    """``start``, ``max_retained_bytes`` and ``catchup_max_share`` (default: the daemon table's) of a consumer
    table; errors name ``source`` and the key."""
    value = table.get("start", "oldest")
    if value not in ("oldest", "now"):
        raise ConfigError(f'{source}: key \'start\': {value!r}: must be "oldest" or "now"')
    cap = table.get("max_retained_bytes", 0)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ConfigError(f"{source}: key 'max_retained_bytes': {cap!r}: must be a whole number of bytes >= 0")
    share = table.get("catchup_max_share", default_share)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
        raise ConfigError(f"{source}: key 'catchup_max_share': {share!r}: must be a number > 0 and <= 1")
    return LanePolicy(start=value, max_retained_bytes=cap, catchup_max_share=float(share))


def _env_value(text: str) -> Any:
    """Environment values are TOML scalars when they parse as one (``5``, ``true``), else strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


NON_CONFIG_ENV: dict[str, str] = {
    "CDCD_CONFIG": "the config file, for `cdcd run` without --config",
    "CDCD_FAILPOINTS": "crash points for tests (cdcd/failpoints.py)",
    "CDCD_FAILPOINTS_DIR": "where paused fail points put their markers (tests)",
    "CDCD_SPARK_JARS_DIR": "where the Delta jars are (default <venv>/jars)",
    "CDCD_LAKE_ROWS": "the lake row builder: c (default) or python",
    "CDCD_WAL_ENTRIES": "how DataRecords' entries are checked: c (default) or python (decoded at once)",
    "CDCD_BENCH_DIR": "benchmarks' scratch dir",
    "CDCD_FUZZ_SCRATCH": "the fuzzer's scratch dir",
    "CDCD_KAFKA_CLUSTER": "run the three-broker Kafka test",
    "CDCD_STRICT_CONFIG": "refuse deprecated config spellings, as cdcd --strict-config",
}
"""``CDCD_*`` variables that are not config keys: accepted, never read as config (docs/daemon.md)."""


def env_overrides(
    environ: Mapping[str, str], fields: Iterable[str] | None = None, ignored: list[str] | None = None
) -> dict[str, Any]:
    """``CDCD_BATCH_MAX_EVENTS=5`` → ``batch_max_events = 5``; ``CDCD_CONSUMER__PATH=x`` → ``[consumer] path``.

    Only names whose first part is a config key (``fields``, default DaemonConfig's) are read. Any
    other ``CDCD_*`` name (a deployment's own variable) is appended to ``ignored`` for the caller
    to warn about once logging is set up, unless it is one of ``NON_CONFIG_ENV``; a name within a
    typo of a real key is a ConfigError naming both."""
    known = set(DaemonConfig.__struct_fields__ if fields is None else fields)
    out: dict[str, Any] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if parts[0] not in known:
            close = close_key(parts[0], known)
            if close:
                raise ConfigError(f"environment: {name} does not name a config key; did you mean CDCD_{close.upper()}?")
            if ignored is not None:
                ignored.append(name)
            continue
        target = out
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = _env_value(text)
    return out


def _merge(data: dict[str, Any], env: Mapping[str, Any]) -> None:
    """``env``'s keys into ``data``, tables merged key by key at every depth (``CDCD_CONSUMERS__LAKE__PATH``)."""
    for key, value in env.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            merged = dict(data[key])
            _merge(merged, value)
            data[key] = merged
        else:
            data[key] = value


def load_daemon_config(
    path: str | os.PathLike[str], environ: Mapping[str, str] | None = None, ignored: list[str] | None = None
) -> DaemonConfig:
    """The config at ``path`` with ``CDCD_*`` overrides; ``ignored`` collects other ``CDCD_*`` names."""
    data = read_toml(path)
    env = env_overrides(os.environ if environ is None else environ, ignored=ignored)
    _merge(data, env)
    if "has_default_consumer" in data:
        raise ConfigError(f"{path}: unknown key 'has_default_consumer'")
    data["has_default_consumer"] = "consumer" in data or not data.get("consumers")
    config = convert(data, DaemonConfig, str(path))
    for name, table in config.named_consumers().items():
        key = config.consumer_key(name)
        if "kind" not in table:
            raise ConfigError(f"{path}: missing key '{key}.kind'")
        CacheFilter.from_table(table, f"{path}: {key}")
        lane_policy(table, f"{path}: {key}", config.catchup_max_share)
    try:
        config.node()
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config
