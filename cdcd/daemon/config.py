"""Daemon configuration (``config/cdcd.toml``), with ``CDCD_*`` environment overrides."""

from __future__ import annotations

import os
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

    def __post_init__(self) -> None:
        if not self.node_dir:
            raise msgspec.ValidationError("must not be empty - at `$.node_dir`")
        checks = {
            "lock_timeout_ms": self.lock_timeout_ms >= 0,
            "check_interval_ms": self.check_interval_ms >= 10,
            "batch_max_events": self.batch_max_events >= 1,
            "batch_max_bytes": self.batch_max_bytes >= 1024,
            "batch_max_delay_ms": self.batch_max_delay_ms >= 0,
            "queue_max_batches": self.queue_max_batches >= 1,
            "read_chunk_records": self.read_chunk_records >= 1,
            "consumer_stall_timeout_ms": self.consumer_stall_timeout_ms >= 1000,
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

    @property
    def cdc_path(self) -> Path:
        return Path(self.cdc_dir or Path(self.node_dir) / "cdc")

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir or Path(self.node_dir) / "cdcd-state")


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


def load_daemon_config(
    path: str | os.PathLike[str], environ: Mapping[str, str] | None = None, ignored: list[str] | None = None
) -> DaemonConfig:
    """The config at ``path`` with ``CDCD_*`` overrides; ``ignored`` collects other ``CDCD_*`` names."""
    data = read_toml(path)
    env = env_overrides(os.environ if environ is None else environ, ignored=ignored)
    for key, value in env.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    config = convert(data, DaemonConfig, str(path))
    if "kind" not in config.consumer:
        raise ConfigError(f"{path}: missing key 'consumer.kind'")
    CacheFilter.from_table(config.consumer, f"{path}: consumer")
    try:
        config.node()
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config
