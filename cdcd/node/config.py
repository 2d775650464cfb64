"""Node configuration (``config/node.toml``); every size and duration carries its unit in its name."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec

from cdcd.config import BadCacheFilter, CacheFilter, check_address, check_ranges

MiB = 1 << 20
DEFAULT_CONSUMER = "default"
CONSUMER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""The daemon's consumer names (``[consumers.<name>]``), which ``[realtime_consumer] name`` is one of."""
MAX_SOCKET_NAME_BYTES = 80
"""A Unix socket address holds ~108 bytes; a deep directory is reached through /proc/self/fd/N/
(cdcd/control.py), which leaves about this much for the socket's own file name."""


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    consumer_tables: ClassVar[tuple[str, ...]] = ("realtime_consumer",)
    """Read with their deprecated spellings upgraded (``cdcd.config.upgrade_table``)."""

    node_dir: str
    """Root of the node; the paths below default to sub-directories of it."""
    wal_dir: str = ""
    """Work dir holding the active segment (default ``<node_dir>/wal``)."""
    wal_archive_dir: str = ""
    """Archived segments (default ``<wal_dir>/archive``)."""
    cdc_dir: str = ""
    """Hard links to archived segments for the CDC daemon (default ``<node_dir>/cdc``)."""
    db_dir: str = ""
    """LMDB page store and metastorage (default ``<node_dir>/db``)."""

    wal_mode: Literal["fsync", "background"] = "fsync"
    """``fsync``: a commit returns once its record is fsynced (group commit). ``background``: at once."""
    wal_segment_size_bytes: int = 64 * MiB
    wal_buffer_bytes: int = 4 * MiB
    """Append buffer; writers wait for the flusher when it is full."""
    wal_flush_interval_ms: int = 10
    """The flusher writes and fsyncs at least this often when there is data."""
    wal_force_archive_timeout_ms: int = 1000
    """Roll a segment that holds records after this long, so CDC sees them (0: only when full)."""

    cdc_enabled: bool = True
    """Hard-link archived segments into ``cdc_dir``."""
    cdc_dir_max_bytes: int = 0
    """Stop linking (error logged, counted) while the CDC dir holds more than this (0: no limit)."""
    archive_max_bytes: int = 1024 * MiB
    """Delete the oldest archived segments beyond this size (0: keep all); links are never deleted."""

    checkpoint_interval_ms: int = 5000
    ttl_expire_interval_ms: int = 1000
    """How often the checkpointer writes DELETEs for expired entries (see ``put(..., ttl_ms=)``)."""
    ttl_expire_batch_max_entries: int = 10_000
    """Expired entries deleted per round at most (one DataRecord); a full round runs again at once."""
    checkpoint_dirty_max_entries: int = 200_000
    """Changed keys kept in memory before a checkpoint writes them to LMDB; writers wait beyond 2x."""
    lmdb_map_size_bytes: int = 16 * 1024 * MiB

    realtime_cdc: bool = False
    """Capture changes inside the node right after each WAL flush (IEP-104); the daemon goes PASSIVE.
    At every open the node restores an enabled realtime state, or tries to start it (hand-over)."""
    realtime_consumer: dict[str, Any] = msgspec.field(default_factory=dict)
    """The realtime worker's consumer: the same table as the daemon's ``[consumer]``, plus ``name``: the
    daemon's consumer it stands in for (the daemon's ``realtime_consumer``; default ``default``)."""
    cdc_buffer_bytes: int = 0
    """Flushed WAL bytes the realtime worker may hold; over it realtime stops (0: 10 segments' worth)."""
    realtime_batch_max_events: int = 10_000
    realtime_batch_min_interval_ms: int = 0
    """The realtime worker starts a delivery at most this often: what the flusher offers meanwhile joins the
    next batch (a backlog over ``realtime_batch_max_events`` goes on at once, and closing or stopping never
    waits). A consumer that commits per call (the lake: a commit, its files and rewrites) then commits at
    most ``1000 / realtime_batch_min_interval_ms`` times a second whatever the load, for up to this long
    more lag of a batch's first entries. 0: as soon as the last call returned."""
    realtime_commit_record_interval_ms: int = 1000
    """At most this often a RealtimeCdcRecord tells the daemon how far the node delivered."""
    realtime_close_timeout_ms: int = 10_000
    """``close()`` drains the realtime buffer for at most this long."""
    control_socket: str = ""
    """Unix socket for ``cdcd control`` (default ``<node_dir>/control.sock``; mode 0600)."""
    daemon_state_dir: str = ""
    """Where the daemon keeps its state, read by ``status`` (default ``<node_dir>/cdcd-state``)."""

    partitions: int = 1024
    """Default partition count of new caches."""
    cluster_id: int = 1
    """1-31, unique per cluster: the conflict resolver tells local from replicated entries by it."""
    node_order: int = 1
    topology_version: int = 0
    """First field of every version this node writes (0: automatic, grown at every open so a
    restarted, restored or re-created node's writes win over its older ones; see docs/replication.md).
    A fixed value is for reproducible output only: it gives that guarantee up."""

    replication_listen: str = ""
    """host:port of the replication endpoint other clusters' daemons send changes to ("": off)."""
    replication_token_file: str = ""
    """File (mode 0600) holding the shared token; required when listening."""
    replication_tls_cert: str = ""
    replication_tls_key: str = ""
    """PEM certificate and key: the endpoint speaks TLS when set."""
    replication_tls_ca: str = ""
    """PEM CA bundle: when set, peers must present a certificate it signed."""
    replication_max_connections: int = 16
    replication_max_frame_bytes: int = 64 * MiB
    replication_auth_timeout_ms: int = 10_000
    """A peer's whole handshake (TLS and hello) must finish within this, or it is disconnected."""
    conflict_resolve_field: str = ""
    """Value field compared when two clusters changed a key (higher wins); see the README."""
    replication_resolver: str = ""
    """``package.module:Class``: a ConflictResolver subclass used instead of the default rules."""
    log_keys: bool = False
    """The conflict resolver's log lines carry keys in clear, not their hash (warned at start)."""
    metrics_address: str = ""
    """host:port of the node's Prometheus endpoint under ``cdcd node run`` ("": off)."""

    def __post_init__(self) -> None:
        checks = {
            "wal_segment_size_bytes": self.wal_segment_size_bytes >= 4096,
            "wal_buffer_bytes": self.wal_buffer_bytes >= 4096,
            "wal_flush_interval_ms": self.wal_flush_interval_ms >= 1,
            "wal_force_archive_timeout_ms": self.wal_force_archive_timeout_ms >= 0,
            "cdc_dir_max_bytes": self.cdc_dir_max_bytes >= 0,
            "archive_max_bytes": self.archive_max_bytes >= 0,
            "checkpoint_interval_ms": self.checkpoint_interval_ms >= 1,
            "ttl_expire_interval_ms": self.ttl_expire_interval_ms >= 1,
            "ttl_expire_batch_max_entries": self.ttl_expire_batch_max_entries >= 1,
            "checkpoint_dirty_max_entries": self.checkpoint_dirty_max_entries >= 1,
            "partitions": 1 <= self.partitions <= 65536,
            "cluster_id": 1 <= self.cluster_id <= 31,
            "replication_max_connections": self.replication_max_connections >= 1,
            "replication_max_frame_bytes": self.replication_max_frame_bytes >= 4096,
            "replication_auth_timeout_ms": self.replication_auth_timeout_ms >= 1,
            "node_order": self.node_order >= 0,
            "topology_version": self.topology_version >= 0,
            "cdc_buffer_bytes": self.cdc_buffer_bytes >= 0,
            "realtime_batch_max_events": self.realtime_batch_max_events >= 1,
            "realtime_batch_min_interval_ms": 0 <= self.realtime_batch_min_interval_ms <= 60_000,
            "realtime_commit_record_interval_ms": self.realtime_commit_record_interval_ms >= 0,
            "realtime_close_timeout_ms": self.realtime_close_timeout_ms >= 0,
        }
        if not self.node_dir:
            raise msgspec.ValidationError("must not be empty - at `$.node_dir`")
        socket_name = len(os.fsencode(self.control_socket_path.name))
        if socket_name > MAX_SOCKET_NAME_BYTES:
            raise msgspec.ValidationError(
                f"file name of {socket_name} bytes, over the {MAX_SOCKET_NAME_BYTES} a Unix socket "
                "address leaves (the directory may be long) - at `$.control_socket`"
            )
        if self.realtime_cdc and not self.realtime_consumer:
            raise msgspec.ValidationError(
                "realtime_cdc = true needs a realtime_consumer table - at `$.realtime_consumer`"
            )
        name = self.realtime_consumer.get("name", DEFAULT_CONSUMER)
        if not isinstance(name, str) or not CONSUMER_NAME.fullmatch(name):
            raise msgspec.ValidationError(
                f"{name!r}: not a consumer name (1 to 64 of A-Z a-z 0-9 _ -) - at `$.realtime_consumer.name`"
            )
        try:
            CacheFilter.parse(self.realtime_consumer)
        except BadCacheFilter as exc:
            raise msgspec.ValidationError(f"{exc.what} - at `$.realtime_consumer.{exc.key}`") from None
        check_ranges(self, checks)
        check_address(self.replication_listen, "replication_listen")
        check_address(self.metrics_address, "metrics_address")
        if self.replication_listen and not self.replication_token_file:
            raise msgspec.ValidationError(
                "replication_listen needs a replication_token_file - at `$.replication_token_file`"
            )

    @property
    def realtime_consumer_name(self) -> str:
        """The daemon's consumer the realtime worker delivers to (``[realtime_consumer] name``)."""
        return str(self.realtime_consumer.get("name", DEFAULT_CONSUMER))

    @property
    def realtime_consumer_table(self) -> dict[str, Any]:
        """``[realtime_consumer]`` as the consumer's own table: its name is the node's, not the consumer's."""
        return {k: v for k, v in self.realtime_consumer.items() if k != "name"}

    @property
    def wal_path(self) -> Path:
        return Path(self.wal_dir or Path(self.node_dir) / "wal")

    @property
    def archive_path(self) -> Path:
        return Path(self.wal_archive_dir or self.wal_path / "archive")

    @property
    def cdc_path(self) -> Path:
        return Path(self.cdc_dir or Path(self.node_dir) / "cdc")

    @property
    def db_path(self) -> Path:
        return Path(self.db_dir or Path(self.node_dir) / "db")

    @property
    def control_socket_path(self) -> Path:
        return Path(self.control_socket or Path(self.node_dir) / "control.sock")

    @property
    def daemon_state_path(self) -> Path:
        return Path(self.daemon_state_dir or Path(self.node_dir) / "cdcd-state")

    @property
    def metastorage_path(self) -> Path:
        return self.db_path / "metastorage"

    @property
    def cdc_buffer_limit_bytes(self) -> int:
        return self.cdc_buffer_bytes or 10 * self.wal_segment_size_bytes

    @property
    def lock_path(self) -> Path:
        return Path(self.node_dir) / "node.lock"
